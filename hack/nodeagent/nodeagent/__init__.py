"""A process "kubelet": runs the pods the kube-scheduler binds to one node as plain processes in network namespaces."""
