// Command kube runs the upstream Kubernetes control-plane components and etcd that baleen's
// real-control-plane lane starts (tests/tests/real), built from their published Go modules and
// linked into one binary so that the packages they share compile once. The first argument (or
// the name the binary is called by) picks the component; the rest are its own flags:
//
//	kube kube-apiserver --etcd-servers=...
//	kube etcd --data-dir=...
//
// Only the harness is Go: baleen itself is Rust. Nothing here is copied from upstream; each
// case calls the command constructor the upstream main calls.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	_ "time/tzdata" // CronJob time zones, as the upstream binaries embed them

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"          // the JSON log format
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go's metrics
	_ "k8s.io/component-base/metrics/prometheus/version"  // the version metric
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

var components = map[string]func() *cobra.Command{
	"kube-apiserver":          apiserver.NewAPIServerCommand,
	"kube-controller-manager": controllermanager.NewControllerManagerCommand,
	"kube-scheduler":          func() *cobra.Command { return scheduler.NewSchedulerCommand() },
}

func usage() {
	names := []string{"etcd"}
	for name := range components {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: kube COMPONENT [FLAGS...], COMPONENT one of %v\n", names)
	os.Exit(64)
}

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args
	if _, known := components[name]; !known && name != "etcd" {
		if len(os.Args) < 2 {
			usage()
		}
		name, args = os.Args[1], os.Args[1:]
	}
	if name == "etcd" {
		etcdmain.Main(args)
		return
	}
	command, known := components[name]
	if !known {
		usage()
	}
	// cobra reads os.Args[1:]: the component's own flags.
	os.Args = args
	os.Exit(cli.Run(command()))
}
