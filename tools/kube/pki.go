package main

import (
	"flag"
	"fmt"
	"net"
	"os"
	"path/filepath"

	"k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/keyutil"
)

// runPKI writes what the API server needs to serve TLS and sign service-account tokens, with
// client-go's own helpers: apiserver.crt (the serving certificate for --host, followed by the CA
// that signed it: clients trust this file), apiserver.key, and sa.key (an ECDSA key).
func runPKI(args []string) int {
	flags := flag.NewFlagSet("pki", flag.ContinueOnError)
	dir := flags.String("dir", "", "directory that receives the files (required)")
	host := flags.String("host", "127.0.0.1", "IP address or DNS name the API server serves on")
	if err := flags.Parse(args); err != nil {
		return 2
	}
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kube pki: --dir is required")
		return 2
	}
	certPEM, keyPEM, err := cert.GenerateSelfSignedCertKey(*host, []net.IP{net.ParseIP("127.0.0.1")}, []string{"localhost"})
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube pki: %v\n", err)
		return 1
	}
	saKey, err := keyutil.MakeEllipticPrivateKeyPEM()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kube pki: %v\n", err)
		return 1
	}
	for name, data := range map[string][]byte{"apiserver.crt": certPEM, "apiserver.key": keyPEM, "sa.key": saKey} {
		if err := os.WriteFile(filepath.Join(*dir, name), data, 0o600); err != nil {
			fmt.Fprintf(os.Stderr, "kube pki: %v\n", err)
			return 1
		}
	}
	return 0
}
