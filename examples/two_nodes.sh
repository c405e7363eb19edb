#!/usr/bin/env bash
# Two nodes, one command on each: examples/own_model.py with tensor parallelism across them.
#
#   on node 0, whose address is HOST0:   examples/two_nodes.sh 0 HOST0
#   on node 1:                           examples/two_nodes.sh 1 HOST0
#   both "nodes" on this machine:        examples/two_nodes.sh local
#
# Node 0 hosts the rendezvous, so HOST0 must be one of node 0's own addresses (or a name that
# resolves to one); every node reaches it on port $PORT (default 29531). Each node's gloo
# traffic uses the interface that routes to HOST0. Set NPROC for processes per node and
# DEGREES for the layout, e.g. NPROC=2 DEGREES="--set parallel.tp=2 --set parallel.dp=2".
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
port=${PORT:-29531}
read -r -a degrees <<< "${DEGREES:---set parallel.tp=2}"

node() {  # node RANK HOST0
    tessera run --nnodes 2 --node-rank "$1" --nproc-per-node "${NPROC:-1}" \
        --rdzv-endpoint "$2:$port" "${degrees[@]}" "$here/own_model.py" --steps "${STEPS:-12}"
}

if [ "${1:-}" = local ]; then
    log=$(mktemp)
    node 1 127.0.0.1 > "$log" 2>&1 &
    other=$!
    status=0
    node 0 127.0.0.1 || status=$?
    # the rendezvous numbers the nodes in the order they join: global rank 0, which prints the
    # losses, may be on either; so node 1's output follows node 0's
    if wait "$other"; then cat "$log"; else echo "node 1 failed:" >&2; cat "$log" >&2; status=1; fi
    rm -f "$log"
    exit "$status"
fi
if [ $# -ne 2 ]; then
    echo "usage: $0 NODE_RANK HOST0   (or: $0 local)" >&2
    exit 2
fi
node "$1" "$2"
