//! Peak memory per rank, predicted (issue 15 §2).
