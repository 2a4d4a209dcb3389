//! How a model's layers are divided among pipeline stages.
//!
//! A split assigns every transformer block to exactly one stage, in order, and at least
//! one block to each stage; the embeddings go with the first stage and the final norm,
//! head and loss with the last. It can be even, explicit (layer counts per stage, which
//! may be uneven) or balanced by cost. Whatever the request, the result is checked: a
//! split that would drop or duplicate a layer, or leave a stage empty, is an error that
//! says what to change — never a silently smaller model.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::ModelError;

/// What one pipeline stage of a layered model runs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StagePlan {
    /// The stage index (0 = first).
    pub stage: usize,
    /// The transformer blocks, by layer index.
    pub blocks: Range<usize>,
    /// Runs the embeddings (the first stage).
    pub embed: bool,
    /// Runs the final norm, the head and the loss (the last stage).
    pub head: bool,
}

/// How to split: `even`, `balanced`, or explicit counts such as `3,2`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(try_from = "String", into = "String")]
pub enum SplitSpec {
    /// Equal counts, the first stages taking one more when it does not divide.
    #[default]
    Even,
    /// Contiguous stages minimising the most expensive stage under [`LayerCosts`].
    Balanced,
    /// Exactly these many blocks per stage.
    Counts(Vec<usize>),
}

impl fmt::Display for SplitSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SplitSpec::Even => write!(f, "even"),
            SplitSpec::Balanced => write!(f, "balanced"),
            SplitSpec::Counts(c) => {
                let s: Vec<String> = c.iter().map(|n| n.to_string()).collect();
                write!(f, "{}", s.join(","))
            }
        }
    }
}

impl FromStr for SplitSpec {
    type Err = ModelError;
    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s.trim() {
            "even" => Ok(SplitSpec::Even),
            "balanced" => Ok(SplitSpec::Balanced),
            other => other
                .split(',')
                .map(|c| {
                    c.trim()
                        .parse::<usize>()
                        .map_err(|_| ModelError::BadSplit(s.to_string()))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(SplitSpec::Counts),
        }
    }
}

impl TryFrom<String> for SplitSpec {
    type Error = ModelError;
    fn try_from(s: String) -> Result<Self, ModelError> {
        s.parse()
    }
}

impl From<SplitSpec> for String {
    fn from(s: SplitSpec) -> String {
        s.to_string()
    }
}

/// Relative costs used by [`SplitSpec::Balanced`], per layer: training FLOPs per token
/// (any unit works as long as all parts use the same one).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerCosts {
    /// The embeddings (run by the first stage).
    pub embed: f64,
    /// Each layer a split divides among the stages, in order.
    pub blocks: Vec<f64>,
    /// The final norm, head and loss (run by the last stage).
    pub head: f64,
}

impl LayerCosts {
    /// `n` layers of cost `block` each, embeddings `embed`, head `head`.
    pub fn uniform(n: usize, embed: f64, block: f64, head: f64) -> LayerCosts {
        LayerCosts {
            embed,
            blocks: vec![block; n],
            head,
        }
    }
}

/// Splits the `costs.blocks.len()` layers over `num_stages` stages.
pub fn plan_stages(
    costs: &LayerCosts,
    num_stages: usize,
    spec: &SplitSpec,
) -> Result<Vec<StagePlan>, ModelError> {
    let n_layer = costs.blocks.len();
    if num_stages == 0 {
        return Err(ModelError::NoStages);
    }
    if num_stages > n_layer {
        return Err(ModelError::TooManyStages {
            stages: num_stages,
            layers: n_layer,
        });
    }
    let counts = match spec {
        SplitSpec::Even => (0..num_stages)
            .map(|s| n_layer / num_stages + usize::from(s < n_layer % num_stages))
            .collect(),
        SplitSpec::Balanced => balanced(num_stages, costs),
        SplitSpec::Counts(c) => c.clone(),
    };
    check_counts(&counts, n_layer, num_stages)?;
    let mut start = 0;
    Ok(counts
        .iter()
        .enumerate()
        .map(|(stage, &c)| {
            let p = StagePlan {
                stage,
                blocks: start..start + c,
                embed: stage == 0,
                head: stage + 1 == num_stages,
            };
            start += c;
            p
        })
        .collect())
}

fn check_counts(counts: &[usize], n_layer: usize, num_stages: usize) -> Result<(), ModelError> {
    if counts.len() != num_stages {
        return Err(ModelError::Split(format!(
            "the split {} gives {} stages but the pipeline has {num_stages}",
            SplitSpec::Counts(counts.to_vec()),
            counts.len()
        )));
    }
    if let Some(s) = counts.iter().position(|&c| c == 0) {
        return Err(ModelError::Split(format!(
            "the split {} leaves stage {s} without layers; every stage needs at least one",
            SplitSpec::Counts(counts.to_vec())
        )));
    }
    let Some(total) = counts.iter().try_fold(0usize, |t, &c| t.checked_add(c)) else {
        return Err(ModelError::Split(format!(
            "the split {} asks for more layers than the model's {n_layer}",
            SplitSpec::Counts(counts.to_vec())
        )));
    };
    if total < n_layer {
        return Err(ModelError::Split(format!(
            "the split {} covers {total} layers but the model has {n_layer}: layers {total}..{n_layer} would be dropped",
            SplitSpec::Counts(counts.to_vec())
        )));
    }
    if total > n_layer {
        return Err(ModelError::Split(format!(
            "the split {} asks for {total} layers but the model has only {n_layer}",
            SplitSpec::Counts(counts.to_vec())
        )));
    }
    Ok(())
}

/// Contiguous counts minimising the most expensive stage (the embeddings count on the
/// first stage, the head on the last); ties prefer fewer layers on earlier stages.
fn balanced(s: usize, c: &LayerCosts) -> Vec<usize> {
    let n = c.blocks.len();
    // prefix[i]: the cost of blocks 0..i.
    let prefix: Vec<f64> = std::iter::once(0.0)
        .chain(c.blocks.iter().scan(0.0, |t, &b| {
            *t += b;
            Some(*t)
        }))
        .collect();
    let cost = |stage: usize, from: usize, to: usize| {
        let mut x = prefix[to] - prefix[from];
        if stage == 0 {
            x += c.embed;
        }
        if stage + 1 == s {
            x += c.head;
        }
        x
    };
    // best[k][i]: the least possible maximum when stages 0..k hold blocks 0..i.
    let inf = f64::INFINITY;
    let mut best = vec![vec![inf; n + 1]; s + 1];
    let mut cut = vec![vec![0usize; n + 1]; s + 1];
    best[0][0] = 0.0;
    for k in 1..=s {
        for i in k..=n {
            for j in (k - 1)..i {
                let v = best[k - 1][j].max(cost(k - 1, j, i));
                if v < best[k][i] - 1e-12 {
                    best[k][i] = v;
                    cut[k][i] = j;
                }
            }
        }
    }
    let mut counts = vec![0; s];
    let mut i = n;
    for k in (1..=s).rev() {
        let j = cut[k][i];
        counts[k - 1] = i - j;
        i = j;
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flat(n: usize) -> LayerCosts {
        LayerCosts::uniform(n, 0.0, 1.0, 0.0)
    }

    fn counts(p: &[StagePlan]) -> Vec<usize> {
        p.iter().map(|s| s.blocks.len()).collect()
    }

    #[test]
    fn even_split_covers_every_layer_once() {
        for n in 1..=12 {
            for s in 1..=n {
                let p = plan_stages(&flat(n), s, &SplitSpec::Even).unwrap();
                assert_eq!(p.len(), s);
                assert_eq!(p[0].blocks.start, 0);
                assert_eq!(p[s - 1].blocks.end, n);
                for w in p.windows(2) {
                    assert_eq!(w[0].blocks.end, w[1].blocks.start);
                }
                assert!(p.iter().all(|x| !x.blocks.is_empty()));
                assert!(p[0].embed && p[s - 1].head);
            }
        }
        assert_eq!(
            counts(&plan_stages(&flat(5), 2, &SplitSpec::Even).unwrap()),
            [3, 2]
        );
    }

    #[test]
    fn explicit_uneven_counts_are_honoured() {
        let p = plan_stages(&flat(5), 2, &"1,4".parse().unwrap()).unwrap();
        assert_eq!(p[0].blocks, 0..1);
        assert_eq!(p[1].blocks, 1..5);
    }

    #[test]
    fn a_split_that_drops_or_duplicates_layers_is_refused() {
        // Megatron-LM #1304: 30 layers on 4 stages silently built 28.
        let e = plan_stages(&flat(30), 4, &"7,7,7,7".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("layers 28..30 would be dropped"), "{e}");
        let e = plan_stages(&flat(5), 2, &"3,3".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("asks for 6 layers but the model has only 5"),
            "{e}"
        );
        let e = plan_stages(&flat(5), 2, &"5,0".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("leaves stage 1 without layers"), "{e}");
        let e = plan_stages(&flat(5), 3, &"3,2".parse().unwrap())
            .unwrap_err()
            .to_string();
        assert!(e.contains("gives 2 stages but the pipeline has 3"), "{e}");
        // Counts whose sum overflows are refused, not added up.
        let split = "18446744073709551615,1".parse().unwrap();
        let e = plan_stages(&flat(5), 2, &split).unwrap_err().to_string();
        assert!(
            e.contains("the split 18446744073709551615,1 asks for more layers than the model's 5"),
            "{e}"
        );
    }

    #[test]
    fn more_stages_than_layers_is_refused() {
        let e = plan_stages(&flat(3), 4, &SplitSpec::Even)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("4 stages but the model has only 3 layers"),
            "{e}"
        );
    }

    #[test]
    fn balanced_split_moves_layers_off_expensive_ends() {
        let c = LayerCosts::uniform(8, 0.5, 1.0, 2.0);
        let p = plan_stages(&c, 2, &SplitSpec::Balanced).unwrap();
        // Stage costs: 0.5 + 5 = 5.5 and 3 + 2 = 5.
        assert_eq!(counts(&p), [5, 3]);
        let p = plan_stages(&flat(6), 3, &SplitSpec::Balanced).unwrap();
        assert_eq!(counts(&p), [2, 2, 2]);
    }

    #[test]
    fn balanced_split_follows_per_layer_costs() {
        // An expensive first layer: the even split [4, 3] would cost 7 against 3;
        // balancing gives 5 and 5.
        let c = LayerCosts {
            embed: 0.0,
            blocks: vec![4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            head: 0.0,
        };
        let p = plan_stages(&c, 2, &SplitSpec::Balanced).unwrap();
        assert_eq!(counts(&p), [2, 5]);
        assert_eq!(p[1].blocks, 2..7);
        // Rising costs: later stages get fewer layers.
        let c = LayerCosts {
            embed: 0.0,
            blocks: vec![1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0],
            head: 0.0,
        };
        let p = plan_stages(&c, 3, &SplitSpec::Balanced).unwrap();
        // Stage costs 6, 6 and 4: no cut keeps every stage below 6.
        assert_eq!(counts(&p), [5, 2, 1]);
        // Uniform costs give the same split as before.
        let p = plan_stages(&flat(6), 3, &SplitSpec::Balanced).unwrap();
        assert_eq!(counts(&p), [2, 2, 2]);
    }

    #[test]
    fn split_spec_text_round_trips() {
        for s in ["even", "balanced", "3,2,1"] {
            assert_eq!(s.parse::<SplitSpec>().unwrap().to_string(), s);
        }
        assert!("3,x".parse::<SplitSpec>().is_err());
    }
}
