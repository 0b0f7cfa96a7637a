// pause is the sandbox ("infra") process of every pod on the local cluster's nodes: it holds the pod's namespaces,
// reaps the zombies of processes that share its PID namespace, and exits on SIGINT or SIGTERM.
// It replaces registry.k8s.io/pause, which no registry reachable from this machine serves.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range signals {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
