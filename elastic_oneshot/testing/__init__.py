"""Helpers the tests, the chaos harness (launch/chaos.py) and the benchmarks (bench/) share: a throwaway etcd
(etcd_server), tiny local models (tiny) and llmcompressor's oneshot on our tokens (peer). Nothing in the package
proper imports them; llmcompressor, a test extra, is imported only when peer runs."""
