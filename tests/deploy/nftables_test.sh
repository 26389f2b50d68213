#!/usr/bin/env bash
# deploy/nftables/moed.nft: nft accepts it, its port range is UCX_TCP_PORT_RANGE of moed.env and of
# the Kubernetes DaemonSets, and it works: loaded in a network namespace, a connection to a port of
# the range from an address outside cluster_nodes is dropped, and goes through once that address
# is added to the set. Both ends live in namespaces of their own: an interface with an address in
# the host's namespace would be picked up by the UCX workers of tests running beside this one, and
# its removal would break their connections.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
[ "$(id -u)" -eq 0 ] || skip "nftables in a network namespace needs root"
command -v nft >/dev/null || need_packages nftables
command -v ip >/dev/null || need_packages iproute2
rules=$MOE_SRC/deploy/nftables/moed.nft
range=$(sed -n 's/^UCX_TCP_PORT_RANGE=//p' "$MOE_SRC/deploy/systemd/moed.env")
[ -n "$range" ] || fail "deploy/systemd/moed.env sets no UCX_TCP_PORT_RANGE"
grep -q "tcp dport $range " "$rules" || fail "moed.nft does not guard UCX_TCP_PORT_RANGE=$range"
for f in moed-cpu.yaml moed-gpu.yaml; do
  grep -A1 'name: UCX_TCP_PORT_RANGE' "$MOE_SRC/deploy/k8s/$f" | grep -q "value: \"$range\"" ||
    fail "deploy/k8s/$f does not set UCX_TCP_PORT_RANGE=$range"
done
nft -c -f "$rules" || fail "nft rejects deploy/nftables/moed.nft"

ns=moe-nft-$$ client=moe-nftc-$$ client_veth=mnftc$$ ns_veth=mnftp$$
cleanup() {
  ip netns del "$ns" 2>/dev/null || true
  ip netns del "$client" 2>/dev/null || true
}
trap cleanup EXIT
ip netns add "$ns" || skip "cannot create a network namespace here"
ip netns add "$client"
ip -n "$ns" link add "$ns_veth" type veth peer name "$client_veth" netns "$client"
ip -n "$client" addr add 10.77.0.1/24 dev "$client_veth"
ip -n "$client" link set "$client_veth" up
ip -n "$ns" addr add 10.77.0.2/24 dev "$ns_veth"
ip -n "$ns" link set "$ns_veth" up
ip -n "$ns" link set lo up
ip netns exec "$ns" nft -f "$rules"
port=${range%-*}
# A listener in the namespace on the first port of the range, answering every connection.
ip netns exec "$ns" python3 -c '
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(8)
while True:
    c, _ = s.accept(); c.sendall(b"ok"); c.close()' "$port" &
listener=$!
trap 'kill $listener 2>/dev/null || true; cleanup' EXIT
reach() {
  ip netns exec "$client" python3 -c '
import socket, sys
try:
    s = socket.create_connection(("10.77.0.2", int(sys.argv[1])), timeout=2); print(s.recv(2).decode())
except OSError:
    print("blocked")' "$port"
}
for _ in $(seq 50); do
  ip netns exec "$ns" python3 -c 'import socket, sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1)' \
    "$port" 2>/dev/null && break # waiting for the listener (loopback is always accepted)
  sleep 0.1
done
[ "$(reach)" = blocked ] || fail "a connection from 10.77.0.1, not in cluster_nodes, reached UCX's port $port"
ip netns exec "$ns" nft add element inet moed cluster_nodes '{ 10.77.0.1 }'
[ "$(reach)" = ok ] || fail "a connection from a cluster node (10.77.0.1) did not reach UCX's port $port"
drops=$(ip netns exec "$ns" nft list chain inet moed input | sed -n 's/.*counter packets \([0-9]*\).*/\1/p')
[ "${drops:-0}" -gt 0 ] || fail "the drop rule counted no packet"
log "nftables: port $port dropped from outside cluster_nodes ($drops packets), open to a cluster node"
