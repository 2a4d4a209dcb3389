//! switchyard-pipeline (under construction)
