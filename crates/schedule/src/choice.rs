//! [`ScheduleChoice`]: what a trainer is told to run, a built-in kind or a CSV file.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Result, ScheduleError};
use crate::generate::ScheduleKind;

/// The schedule a run asks for: a built-in [`ScheduleKind`] by name, or the path of a
/// hand-written schedule in the CSV format of [`Program::load_csv`](crate::Program::load_csv).
///
/// The text form (what a `--schedule` flag or a configuration file holds) is a kind's
/// name (`gpipe`, `1f1b`, `interleaved` or `interleaved:V`, `zb-h1`, `zb-h2`, and their aliases,
/// in any case) or a path. Text that names a kind is that kind; other text is a path if
/// it looks like one — it has a `/`, a `\` or a `.` (an extension, or `./`) — and
/// otherwise an error that lists the kinds. So a file named like a kind is written
/// `./1f1b`, and the file's extension does not matter: its content is read as CSV.
///
/// [`Display`](fmt::Display) writes the text back so that it parses to the same value:
/// a kind's canonical name (`interleaved` for two virtual stages, `interleaved:V`
/// otherwise), a path as given (with `./` in front of a bare file name that would
/// otherwise read as a kind or be refused: the same file). Serde uses the same text, so
/// a configuration file or a checkpoint manifest holds `"1f1b"` or `"mine.csv"`.
///
/// ```
/// use std::path::Path;
/// use switchyard_schedule::{ScheduleChoice, ScheduleKind};
/// let named: ScheduleChoice = "1f1b".parse().unwrap();
/// assert_eq!(named, ScheduleChoice::Named(ScheduleKind::OneFOneB));
/// let file: ScheduleChoice = "schedules/mine.csv".parse().unwrap();
/// assert_eq!(file.path(), Some(Path::new("schedules/mine.csv")));
/// assert_eq!("./1f1b".parse::<ScheduleChoice>().unwrap().path(), Some(Path::new("./1f1b")));
/// assert!("pipedream".parse::<ScheduleChoice>().is_err());
/// assert_eq!(file.to_string(), "schedules/mine.csv");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ScheduleChoice {
    /// A schedule [`generate`](crate::generate) builds.
    Named(ScheduleKind),
    /// A CSV schedule file ([`Program::load_csv`](crate::Program::load_csv)).
    File(PathBuf),
}

impl ScheduleChoice {
    /// The built-in kind, if it is one.
    pub fn kind(&self) -> Option<ScheduleKind> {
        match self {
            ScheduleChoice::Named(k) => Some(*k),
            ScheduleChoice::File(_) => None,
        }
    }

    /// The file's path, if it is a file.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ScheduleChoice::Named(_) => None,
            ScheduleChoice::File(p) => Some(p),
        }
    }

    /// Whether it is the interleaved kind (of any number of virtual stages).
    pub fn is_interleaved(&self) -> bool {
        matches!(
            self,
            ScheduleChoice::Named(ScheduleKind::Interleaved { .. })
        )
    }
}

impl From<ScheduleKind> for ScheduleChoice {
    fn from(kind: ScheduleKind) -> Self {
        ScheduleChoice::Named(kind)
    }
}

impl From<PathBuf> for ScheduleChoice {
    fn from(path: PathBuf) -> Self {
        ScheduleChoice::File(path)
    }
}

/// Whether `text` reads as a path rather than a (mistyped) schedule name.
fn looks_like_path(text: &str) -> bool {
    text.contains(['/', '\\', '.'])
}

impl FromStr for ScheduleChoice {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self> {
        let text = s.trim();
        match text.parse::<ScheduleKind>() {
            Ok(kind) => Ok(ScheduleChoice::Named(kind)),
            Err(e) => {
                // `interleaved:x` is a kind with a bad parameter, not a file.
                let name = text.split_once([':', '=']).map_or(text, |(n, _)| n);
                let kind_name = name.parse::<ScheduleKind>().is_ok();
                if kind_name {
                    Err(e)
                } else if looks_like_path(text) {
                    Ok(ScheduleChoice::File(PathBuf::from(text)))
                } else {
                    Err(ScheduleError::Parse(format!(
                        "unknown schedule {s:?}: expected gpipe, 1f1b, interleaved, zb-h1, zb-h2, or \
                         the path of a CSV schedule such as mine.csv (a file named without a \
                         `.` or `/` is written ./{text})"
                    )))
                }
            }
        }
    }
}

impl fmt::Display for ScheduleChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleChoice::Named(ScheduleKind::Interleaved { virtual_stages: 2 }) => {
                f.write_str("interleaved")
            }
            ScheduleChoice::Named(kind) => kind.fmt(f),
            ScheduleChoice::File(path) => {
                let text = path.display().to_string();
                // A bare name such as `1f1b` would read back as a kind (or be refused).
                match text.parse::<ScheduleChoice>() {
                    Ok(ScheduleChoice::File(p)) if p == *path => f.write_str(&text),
                    _ => write!(f, "./{text}"),
                }
            }
        }
    }
}

impl Serialize for ScheduleChoice {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ScheduleChoice {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> ScheduleChoice {
        s.parse().unwrap_or_else(|e| panic!("{s}: {e}"))
    }

    fn file(s: &str) -> ScheduleChoice {
        ScheduleChoice::File(PathBuf::from(s))
    }

    #[test]
    fn names_are_kinds_and_paths_are_files() {
        use ScheduleKind::*;
        for (text, kind) in [
            ("gpipe", GPipe),
            ("1f1b", OneFOneB),
            ("1F1B", OneFOneB),
            (" pipedream-flush ", OneFOneB),
            ("interleaved", Interleaved { virtual_stages: 2 }),
            ("interleaved:3", Interleaved { virtual_stages: 3 }),
            ("zb-h1", ZbH1),
            ("zb", ZbH1),
            ("zb-h2", ZbH2),
            ("ZBH2", ZbH2),
        ] {
            assert_eq!(parse(text), ScheduleChoice::Named(kind), "{text}");
        }
        for text in [
            "mine.csv",
            "1f1b.csv",
            "./1f1b",
            "schedules/zb-h1",
            "/tmp/a b/x.txt",
            "C:\\schedules\\mine",
            "..",
        ] {
            assert_eq!(parse(text), file(text), "{text}");
        }
    }

    #[test]
    fn other_text_is_refused_with_what_to_write() {
        let e = "pipedream"
            .parse::<ScheduleChoice>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown schedule \"pipedream\""), "{e}");
        assert!(
            e.contains("expected gpipe, 1f1b, interleaved, zb-h1"),
            "{e}"
        );
        assert!(e.contains("./pipedream"), "{e}");
        assert!("".parse::<ScheduleChoice>().is_err());
        // A kind with a bad parameter says what is wrong with the parameter.
        let e = "interleaved:x"
            .parse::<ScheduleChoice>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("virtual stages must be a number"), "{e}");
        let e = "interleaved:2.5"
            .parse::<ScheduleChoice>()
            .unwrap_err()
            .to_string();
        assert!(e.contains("virtual stages must be a number"), "{e}");
        let e = "gpipe:2".parse::<ScheduleChoice>().unwrap_err().to_string();
        assert!(e.contains("only interleaved takes a parameter"), "{e}");
    }

    #[test]
    fn display_reads_back_as_the_same_choice() {
        for (value, text) in [
            (parse("1f1b"), "1f1b"),
            (parse("pipedream-flush"), "1f1b"),
            (parse("GPipe"), "gpipe"),
            (parse("interleaved"), "interleaved"),
            (parse("interleaved:2"), "interleaved"),
            (parse("interleaved:4"), "interleaved:4"),
            (parse("zbh1"), "zb-h1"),
            (file("mine.csv"), "mine.csv"),
            (file("./1f1b"), "./1f1b"),
            (file("1f1b"), "./1f1b"),
            (file("pipedream"), "./pipedream"),
            (file("1f1b=x.csv"), "./1f1b=x.csv"),
            (file("/tmp/x/mine.csv"), "/tmp/x/mine.csv"),
        ] {
            assert_eq!(value.to_string(), text);
            // The same choice, and the same text again; a bare file name comes back with
            // its `./`, the same file.
            let back = parse(text);
            assert_eq!(back.to_string(), text);
            match (&value, &back) {
                (ScheduleChoice::File(a), ScheduleChoice::File(b)) => {
                    assert_eq!(Path::new(".").join(a), Path::new(".").join(b), "{text}")
                }
                _ => assert_eq!(back, value, "{text}"),
            }
        }
    }

    #[test]
    fn serde_uses_the_text_form() {
        for text in [
            "1f1b",
            "interleaved",
            "interleaved:3",
            "zb-h1",
            "gpipe",
            "./1f1b",
            "a/b.csv",
        ] {
            let value = parse(text);
            let json = serde_json::to_string(&value).unwrap();
            assert_eq!(json, format!("{text:?}"));
            assert_eq!(
                serde_json::from_str::<ScheduleChoice>(&json).unwrap(),
                value
            );
        }
        let e = serde_json::from_str::<ScheduleChoice>("\"pipedream\"").unwrap_err();
        assert!(e.to_string().contains("unknown schedule"), "{e}");
        assert!(serde_json::from_str::<ScheduleChoice>("3").is_err());
    }

    #[test]
    fn accessors() {
        assert_eq!(parse("gpipe").kind(), Some(ScheduleKind::GPipe));
        assert_eq!(parse("gpipe").path(), None);
        assert_eq!(parse("x.csv").kind(), None);
        assert!(parse("interleaved:3").is_interleaved());
        assert!(!parse("1f1b").is_interleaved());
        assert!(!parse("interleaved.csv").is_interleaved());
        assert_eq!(ScheduleChoice::from(ScheduleKind::ZbH1), parse("zb-h1"));
        assert_eq!(ScheduleChoice::from(PathBuf::from("a.csv")), file("a.csv"));
    }
}
