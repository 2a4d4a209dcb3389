//! switchyard-shard (under construction)
