//! switchyard-train (under construction)
