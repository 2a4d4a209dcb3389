//! switchyard-models (under construction)
