"""The pieces of `hack/cluster`: a real Kubernetes control plane and netns-isolated nodes without Docker."""
