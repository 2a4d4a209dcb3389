//! Step time, predicted (issue 15 §3).
