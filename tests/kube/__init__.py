"""A real Kubernetes control plane for the tests, with fake GPU nodes and a fake kubelet.

- ``controlplane``: etcd, kube-apiserver, kube-controller-manager, kube-scheduler (the upstream
  commands, linked into `.tools/bin/kube` by `make kube` from ``tools/kube``).
- ``cluster``: one cluster shared by every pytest process of a run, or kept up by
  `make cluster-up`; storage classes with a hostPath provisioner, the upstream CRDs, node
  heartbeats.
- ``nodes``: fake nodes shaped like the values files' pools.
- ``kubelet``: moves the pods bound to them through their lifecycle by rules the tests set.
- ``api``: a small client of the API server.
- ``fixtures``: the pytest fixtures (``kube``, ``kubelet``, ``sandbox``).
"""
