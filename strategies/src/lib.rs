//! The sharding compiler (work in progress).
