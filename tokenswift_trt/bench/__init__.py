"""Benchmarks: AR vs TokenSwift on one engine, with speed, acceptance and repetition metrics."""
