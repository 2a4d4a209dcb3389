//! The schedule a run executes: a generated one or a CSV file, lowered to one pipeline's
//! program and validated, with what to change when it does not fit the layout.

use switchyard_schedule::{
    generate, lower_with_costs, validate, Costs, Program, ScheduleChoice, ScheduleKind,
};

use super::TrainConfig;
use crate::error::{err, TrainError};

/// The costs the trainer's programs are lowered with (where each receive goes among a
/// rank's computations, [`switchyard_schedule::lower_with_costs`]): a split backward's
/// `I` costs more than its `W`, as measured on the reference GPT (`I` also runs the
/// attention's and the LayerNorms' backward; AMD EPYC, pp 2: F 50, I 62, W 40 ms). With
/// equal halves every message's time ties with a computation's start, and a receive
/// went before a forward it does not feed, which then waited for it (ZB-H1's measured
/// bubble was 11 % on both ranks, the simulator's 4 %; now 7 % and 6 %).
const LOWERING_COSTS: Costs = Costs {
    f: 1.0,
    b: 2.0,
    i: 1.25,
    w: 0.75,
    comm: 0.0,
};

impl<M> TrainConfig<M> {
    /// The lowered, validated schedule program of one pipeline (all `pp` ranks).
    pub fn program(&self) -> Result<Program, TrainError> {
        let program = if let ScheduleChoice::File(path) = &self.schedule {
            let p = Program::load_csv(path).map_err(|e| {
                TrainError::Config(match e {
                    switchyard_schedule::ScheduleError::Io { source, .. } => format!(
                        "--schedule {}: cannot read the schedule file: {source} (--schedule takes \
                     gpipe, 1f1b, interleaved, zb-h1 or the path of a CSV schedule)",
                        self.schedule
                    ),
                    e => e.to_string(),
                })
            })?;
            let what = format!("the schedule {}", self.schedule);
            if p.num_ranks() != self.pp {
                return Err(err!(
                    Config,
                    "{what} has {} ranks but --pp is {}",
                    p.num_ranks(),
                    self.pp
                ));
            }
            if p.num_microbatches as usize != self.microbatches {
                return Err(err!(
                    Config,
                    "{what} has {} microbatches but --microbatches is {}",
                    p.num_microbatches,
                    self.microbatches
                ));
            }
            if p.num_stages as usize != self.num_stages() {
                let stages = p.num_stages as usize;
                return Err(if stages.is_multiple_of(self.pp) {
                    err!(
                        Config,
                        "{what} has {stages} stages on {} ranks: pass --virtual-stages {}",
                        self.pp,
                        stages / self.pp
                    )
                } else {
                    err!(
                        Config,
                        "{what} has {stages} stages on {} ranks: every rank must run the same \
                         number of stages, so a schedule for --pp {} needs a multiple of {} stages",
                        self.pp,
                        self.pp,
                        self.pp
                    )
                });
            }
            p
        } else {
            generate(self.schedule_kind()?, self.pp, self.microbatches)?
        };
        let program = match program.is_lowered() || program.num_ranks() == 1 {
            true => program,
            false => lower_with_costs(&program, &LOWERING_COSTS)?,
        };
        validate(&program).map_err(|e| err!(Config, "invalid schedule: {e}"))?;
        Ok(program)
    }

    /// The schedule kind to generate, with `virtual_stages` for interleaving (an error
    /// for a CSV file, which is loaded instead).
    ///
    /// `virtual_stages` is the one count of model chunks: `interleaved:V` in the schedule
    /// must agree with it (plain `interleaved`, which reads as `interleaved:2`, takes it).
    pub fn schedule_kind(&self) -> Result<ScheduleKind, TrainError> {
        match self.schedule {
            ScheduleChoice::File(_) => Err(err!(
                Config,
                "the schedule {} is a file, not a kind to generate",
                self.schedule
            )),
            ScheduleChoice::Named(ScheduleKind::Interleaved { virtual_stages: v }) => {
                if v != 2 && v != self.virtual_stages {
                    return Err(err!(
                        Config,
                        "--schedule {} asks for {v} virtual stages but --virtual-stages is {}: \
                         give the count once, with --virtual-stages",
                        self.schedule,
                        self.virtual_stages
                    ));
                }
                Ok(ScheduleKind::Interleaved {
                    virtual_stages: self.virtual_stages,
                })
            }
            ScheduleChoice::Named(kind) if self.virtual_stages != 1 => Err(err!(
                Config,
                "--virtual-stages {} only applies to the interleaved schedule, not {kind}",
                self.virtual_stages
            )),
            ScheduleChoice::Named(kind) => Ok(kind),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err, sched, TrainConfig};
    use switchyard_schedule::ScheduleChoice;

    #[test]
    fn a_schedule_file_that_cannot_be_read_says_what_the_flag_takes() {
        let e = err(|c| c.schedule = sched("my-schedule.txt"));
        assert!(
            e.starts_with("--schedule my-schedule.txt: cannot read the schedule file: "),
            "{e}"
        );
        assert!(
            e.contains("gpipe, 1f1b, interleaved, zb-h1 or the path of a CSV"),
            "{e}"
        );
        // Any extension: the content is what is read as CSV.
        let dir = std::env::temp_dir().join(format!("switchyard-ext-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("1f1b");
        std::fs::write(&path, "0,0F0,0B0\n1,1F0,1B0\n").unwrap();
        let mut c = TrainConfig {
            schedule: ScheduleChoice::File(path.clone()),
            microbatches: 1,
            batch: 4,
            ..TrainConfig::default()
        };
        c.validate().unwrap();
        assert_eq!(c.program().unwrap().num_microbatches, 1);
        std::fs::write(&path, "not a schedule\n").unwrap();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("the first column must be the rank index"), "{e}");
        c.schedule = sched("1f1b");
        c.validate().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn interleaved_takes_its_chunks_from_virtual_stages() {
        let base = |c: &mut TrainConfig| {
            c.virtual_stages = 2;
            c.model.n_layer = 6;
        };
        for (text, v, ok) in [
            ("interleaved", 2, true),
            ("interleaved", 3, true),
            ("interleaved:3", 3, true),
            ("INTERLEAVED", 3, true),
            ("interleaved:3", 2, false),
        ] {
            let mut c = TrainConfig::default();
            base(&mut c);
            c.schedule = sched(text);
            c.virtual_stages = v;
            match c.validate() {
                Ok(()) => {
                    assert!(ok, "{text} v {v}");
                    assert_eq!(c.program().unwrap().num_stages as usize, 2 * v);
                }
                Err(e) => {
                    assert!(!ok, "{text} v {v}: {e}");
                    assert!(
                        e.to_string().contains("--schedule interleaved:3 asks for 3 virtual stages but --virtual-stages is 2"),
                        "{e}"
                    );
                }
            }
        }
        let e = err(|c| c.schedule = sched("interleaved:3"));
        assert!(e.contains("asks for 3 virtual stages"), "{e}");
    }

    #[test]
    fn a_csv_whose_stages_do_not_share_out_says_so() {
        let dir = std::env::temp_dir().join(format!("switchyard-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // 3 stages on 2 ranks: no --virtual-stages fits.
        let path = dir.join("three.csv");
        std::fs::write(&path, "0,0F0,2F0,2B0,0B0\n1,1F0,1B0\n").unwrap();
        let e = err(|c| {
            c.schedule = ScheduleChoice::File(path.clone());
            c.microbatches = 1;
            c.model.n_layer = 4;
        });
        assert!(
            e.contains("has 3 stages on 2 ranks: every rank must run the same number of stages"),
            "{e}"
        );
        assert!(!e.contains("--virtual-stages 1"), "{e}");
        // 4 stages on 2 ranks: the advice is accepted.
        let path = dir.join("four.csv");
        std::fs::write(&path, interleaved_csv()).unwrap();
        let set = |c: &mut TrainConfig| {
            c.schedule = ScheduleChoice::File(path.clone());
            c.microbatches = 2;
            c.batch = 4;
        };
        let e = err(set);
        assert!(e.contains("pass --virtual-stages 2"), "{e}");
        let mut c = TrainConfig::default();
        set(&mut c);
        c.virtual_stages = 2;
        c.validate().unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn interleaved_csv() -> String {
        switchyard_schedule::interleaved(2, 2, 2).unwrap().to_csv()
    }
}
