//! The memory walk on a tiny GPT ([`super::estimate_memory`]).

use switchyard_models::GptConfig;

use super::*;

fn gpt() -> TrainConfig<GptConfig> {
    TrainConfig {
        model: GptConfig::tiny(4),
        seq_len: 16,
        batch: 8,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

#[test]
fn the_first_stage_of_one_f_one_b_holds_the_most_and_gpipe_more() {
    let c = gpt();
    let r = estimate_memory(&c).unwrap();
    assert_eq!(r.len(), c.pp);
    assert!(r[0].at_peak[Category::Activations as usize] > r[1].at_peak[3]);
    let mut g = c.clone();
    g.schedule = "gpipe".parse().unwrap();
    let rg = estimate_memory(&g).unwrap();
    assert!(rg[0].at_peak[3] > r[0].at_peak[3]);
    // Parameters and optimizer state do not depend on the schedule.
    assert_eq!(rg[0].at_peak[0], r[0].at_peak[0]);
    assert_eq!(rg[0].at_peak[2], r[0].at_peak[2]);
    assert_eq!(r[0].at_peak.iter().sum::<usize>(), r[0].peak_bytes);
}
