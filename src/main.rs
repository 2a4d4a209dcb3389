fn main() {
    println!("switchyard: under construction");
}
