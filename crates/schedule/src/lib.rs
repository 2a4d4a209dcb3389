//! switchyard-schedule (under construction)
