"""Real services on one machine, for trying ftrain and for testing it: a local etcd and SeaweedFS
S3 (:mod:`ftrain.testbed.stack`). Used by ``ftrain local up``, the demo, the benchmarks, chaos and the
tests; the runtime, the checkpoint service and the node agent never import it.
"""
