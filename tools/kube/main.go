// Command kube is the Kubernetes control plane the chart's tests run against: the upstream
// kube-apiserver, kube-controller-manager and kube-scheduler commands and an embedded etcd,
// linked into one binary so their shared packages compile once.
//
//	kube etcd --data-dir DIR --url-file FILE
//	kube pki --dir DIR [--host 127.0.0.1]
//	kube kube-apiserver [upstream flags]
//	kube kube-controller-manager [--job-pod-failure-backoff DURATION] [upstream flags]
//	kube kube-scheduler [upstream flags]
//
// The component is the first argument, or the program name when the binary is called through
// a link named after a component.
//
// --job-pod-failure-backoff (ours, not upstream's) sets the delay before the Job controller
// creates a failed pod's replacement, doubled at each further failure (upstream: 10 s, not a
// flag): what the controller does is the same, sooner.
package main

import (
	"context"
	"flag"
	"fmt"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
	_ "time/tzdata" // CronJob time zones, as the upstream mains

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	"k8s.io/kubernetes/pkg/controller/job"
)

const usage = "usage: kube {etcd|kube-apiserver|kube-controller-manager|kube-scheduler|pki} [flags]"

func main() {
	name := filepath.Base(os.Args[0])
	args := os.Args[1:]
	if _, known := components[name]; !known {
		if len(args) == 0 {
			fmt.Fprintln(os.Stderr, usage)
			os.Exit(2)
		}
		name, args = args[0], args[1:]
	}
	run, known := components[name]
	if !known {
		fmt.Fprintf(os.Stderr, "kube: unknown component %q\n%s\n", name, usage)
		os.Exit(2)
	}
	// The upstream commands parse os.Args[1:] themselves.
	os.Args = append([]string{name}, args...)
	os.Exit(run(args))
}

var components = map[string]func(args []string) int{
	"etcd": runEtcd,
	"kube-apiserver": func([]string) int {
		return cli.Run(apiserver.NewAPIServerCommand())
	},
	"kube-controller-manager": func([]string) int {
		if err := jobPodFailureBackoff(); err != nil {
			fmt.Fprintf(os.Stderr, "kube kube-controller-manager: %v\n", err)
			return 2
		}
		return cli.Run(controllermanager.NewControllerManagerCommand())
	},
	"kube-scheduler": func([]string) int {
		return cli.Run(scheduler.NewSchedulerCommand())
	},
	"pki": runPKI,
}

const backoffFlag = "--job-pod-failure-backoff"

// jobPodFailureBackoff takes --job-pod-failure-backoff=DURATION (or its value as the next
// argument) out of os.Args, before the upstream command parses them, and sets the Job
// controller's first pod failure backoff to it.
func jobPodFailureBackoff() error {
	kept := os.Args[:1:1]
	for i := 1; i < len(os.Args); i++ {
		arg := os.Args[i]
		value, found := strings.CutPrefix(arg, backoffFlag+"=")
		if arg == backoffFlag {
			if i+1 == len(os.Args) {
				return fmt.Errorf("%s needs a duration", backoffFlag)
			}
			i++
			value, found = os.Args[i], true
		}
		if !found {
			kept = append(kept, arg)
			continue
		}
		backoff, err := time.ParseDuration(value)
		if err != nil || backoff <= 0 {
			return fmt.Errorf("%s %q: a positive duration, such as 1s", backoffFlag, value)
		}
		job.DefaultJobPodFailureBackOff = backoff
	}
	os.Args = kept
	return nil
}

// runEtcd serves a single-member etcd on 127.0.0.1 ports the kernel picks, and writes the
// client URL to --port-file once it serves, so that no caller has to guess a free port.
func runEtcd(args []string) int {
	flags := flag.NewFlagSet("etcd", flag.ContinueOnError)
	dataDir := flags.String("data-dir", "", "directory for etcd's data (required)")
	urlFile := flags.String("url-file", "", "file that receives the client URL once etcd serves (required)")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if *dataDir == "" || *urlFile == "" {
		fmt.Fprintln(os.Stderr, "kube etcd: --data-dir and --url-file are required")
		return 2
	}
	local := url.URL{Scheme: "http", Host: "127.0.0.1:0"}
	cfg := embed.NewConfig()
	cfg.Dir = *dataDir
	cfg.ListenClientUrls = []url.URL{local}
	cfg.AdvertiseClientUrls = []url.URL{local}
	cfg.ListenPeerUrls = []url.URL{local}
	cfg.AdvertisePeerUrls = []url.URL{{Scheme: "http", Host: "127.0.0.1:2380"}}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "warn"
	// The data of a test cluster need not survive a crash of the machine: no fsync, so that a
	// machine busy with other I/O does not make every write of the API server wait on the disk.
	cfg.UnsafeNoFsync = true
	// The gateway (etcd's HTTP/JSON API) would dial the configured port 0; the API server
	// speaks gRPC.
	cfg.EnableGRPCGateway = false
	server, err := embed.StartEtcd(cfg)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube etcd: %v\n", err)
		return 1
	}
	defer server.Close()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	select {
	case <-server.Server.ReadyNotify():
	case err := <-server.Err():
		fmt.Fprintf(os.Stderr, "kube etcd: %v\n", err)
		return 1
	case <-ctx.Done():
		return 0
	}
	clientURL := "http://" + server.Clients[0].Addr().String()
	if err := writeAtomically(*urlFile, clientURL+"\n"); err != nil {
		fmt.Fprintf(os.Stderr, "kube etcd: %v\n", err)
		return 1
	}
	select {
	case err := <-server.Err():
		fmt.Fprintf(os.Stderr, "kube etcd: %v\n", err)
		return 1
	case <-ctx.Done():
		return 0
	}
}

func writeAtomically(path, text string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
