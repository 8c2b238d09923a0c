#!/usr/bin/env bash
# An emulated multi-node cluster on one Linux machine: node k is the network namespace
# qcb<ID>n<k>, joined to the others through one bridge (qcb<ID>br) in the root namespace. Each
# node's link is shaped with tc tbf to RATE in both directions (the namespace end shapes what the
# node sends, the bridge-side end what it receives), like a switch port. Ranks of one node share
# the namespace and talk over loopback, unshaped (the "NVLink" of this cluster).
#
# Inside every namespace the veth end is called qceth0 and holds 10.77.0.<k+1>/24, so one
# GLOO_SOCKET_IFNAME=qceth0 fits every node. Without it Gloo picks the address of the hostname,
# which here resolves to loopback, and inter-node connections fail. Traffic between ranks of the
# same node still goes over lo: Linux routes packets for a local address through lo whatever
# interface holds it.
#
# The namespaces have no route out and the bridge has no address: nothing here can reach the
# host's network. The kernel has tbf/htb but no netem, so bandwidth is shaped, latency is not.
#
# Latency (--delay-ms D, D >= 0): the nodes are joined through delayline (delayline.c, built
# with gcc on first use) instead of the bridge: one TUN device per node, moved into the node's
# namespace as its qceth0, and one forwarder process in the root namespace that holds every
# packet D ms (after serializing it at RATE on the destination's port) before it writes it to
# the destination's device. MTU 65000 on these devices (the veths carry 64 kB GSO packets too),
# so the forwarder moves few, large packets. bench/cluster/check_link.py measures what a link
# really does (ping RTT, bulk TCP rate).
#
# A firewall (--firewall PORTS, --firewall0 PORTS, --nat-node K): each node's qceth0 lets in a
# new TCP connection (a SYN without ACK) only on the ports PORTS (a comma list; node 0 also on
# --firewall0's, e.g. the rendezvous's), and node --nat-node K lets none in at all, as behind a
# NAT: it may only dial out. Every other packet passes (the answers to a node's own
# connections, every packet of a connection once made), as a stateful firewall lets them. Made
# with tc alone (an ingress qdisc, u32 filters: a SYN to an open port passes, any other SYN is
# redirected by act_mirred to a veth qcfwsink whose peer is down, which drops it), so nothing
# needs installing: kernels without act_gact (tc's "action drop") have mirred. The firewall
# filters TCP only (every link here is TCP). tests/bench/test_cluster_sites.py shows the rules
# bite (and runs the guide's two-site recipe behind them).
#
# Usage (root only):
#   netns.sh up     --id ID --nodes N --rate RATE [--burst 256kb] [--delay-ms D] [--owner PID] \
#                   [--firewall PORTS [--firewall0 PORTS]] [--nat-node K]
#   netns.sh launch --id ID --nodes N --procs P [--timeout S] [--port PORT] [--logdir DIR] \
#                   [--slow-nodes K --slowdown S] [--equal-cpu] [--lost-node K] \
#                   [--linked [--restart-node K [--rejoin-file F]] [--listen PORT]] \
#                   [--elastic --restart-node K --rejoin-file F] \
#                   -- SCRIPT [ARGS...]          # one torchrun per node, in its namespace
#
# Every rank gets QCB_IFACE (its node's interface) and QCB_KILLED_AT (the Unix time at which its
# node's --timeout fires as first launched: a rank can finish its report before it).
#
# Linked nodes (--linked): each node's torchrun is a world of its own (the node), and the nodes
# find each other through qcomm's rendezvous (python -m qcomm.rendezvous), started in node 0's
# namespace on PORT and stopped when the launch ends; every rank gets QCOMM_RENDEZVOUS, its
# node QCB_NODE and the job's nodes QCB_NODES. --restart-node K: node K's torchrun starts its
# ranks again once (--max-restarts 1) after they die, as a restarted machine would. --listen
# PORT: each node accepts its links on one port (QCOMM_LISTEN=10.77.0.<k+1>:PORT, its ranks
# PORT to PORT + P - 1), but the up's --nat-node, which dials all of its links; QCOMM_TOKEN,
# when the launch's environment has it, reaches the rendezvous and every node from there (never
# a command line). Behind a --firewall, the rendezvous's --port defaults to the first port of
# --firewall0.
#
# Elastic nodes (--elastic): one job of torchrun's elastic agents, as DDP users run one across
# machines that come and go: every node's torchrun takes --nnodes N-1:N with the c10d
# rendezvous on node 0 (its agent hosts the store), --max-restarts 3 and settings an operator
# would tune for quick recovery (a dead agent dropped after 3 s without a heartbeat, a round
# closed 2 s after the last arrival). --restart-node K: once node K's torchrun has ended (the
# script killed the node), the launcher waits for the file --rejoin-file, reads {"time": T}
# (wall-clock) from it and starts the node's torchrun again at T, as an operator restarting the
# machine would; the node then rejoins the running job through the rendezvous. The same
# --restart-node K --rejoin-file F with --linked: node K's torchrun (not only its ranks) is
# started again at T.
#
# A planned node loss (--lost-node K, K >= 1; the script kills node K, e.g. workload.py
# --kill-node K): node K's end, whatever its status, stops no other node and is not a failure.
# Once it has ended and every other node's workers have ended too, torchrun's agents there are
# left waiting in torchrun's exit barrier for node K's agent (300 s, not settable from torchrun's
# command line, and SIGTERM is not acted on until the wait returns): after 3 s of grace (an agent
# whose worker failed ends by itself, with its status) they are killed with SIGKILL, and that
# end is not a failure either. The exit status is then the first failure of another node.
#
# Slow nodes: the last K nodes run in a CPU cgroup (cgroup v1 cpu.cfs_quota_us, or v2 cpu.max,
# with a 10 ms period so that the cap bites within a step) whose quota gives each of their
# processes 1/S of the CPU a process of the other nodes gets: with C cores, N nodes of P
# single-threaded processes, a fast process gets f = min(1, C / ((N-K) P + K P / S)) cores and
# a slow node P f / S. A real CPU cap, not a sleep: the slow node's compute, codec work and
# Python overhead all slow down, as on a slower machine. --equal-cpu caps every node at C / N
# cores instead (machines of their own, none taking another's share of the shared cores), and
# a slow node at C / (N S).
#   netns.sh counters --id ID --nodes N          # "k tx_bytes rx_bytes" of each node's qceth0
#   netns.sh down   --id ID
#   netns.sh clean                               # remove clusters whose owner process is gone
#   netns.sh run    --nodes N --procs P --rate RATE [--timeout S] -- SCRIPT [ARGS...]
#                   # up + launch + down (down also on failure or Ctrl-C)
set -euo pipefail

readonly IFACE=qceth0
readonly SUBNET=10.77.0
readonly STATE_DIR=/run/qcomm-netns
readonly MIN_BURST_BYTES=262144 # tbf: a burst below MTU+14 drops every packet; keep it >= 256kb

die() {
    echo "netns.sh: $*" >&2
    exit 2
}

require_root() {
    if [ "$(id -u)" -ne 0 ]; then
        echo "netns.sh: needs root (it creates network namespaces, veth pairs, a bridge and tc" \
            "qdiscs); run it as root or with sudo" >&2
        exit 1
    fi
}

ns_name() { echo "qcb${1}n${2}"; }
br_name() { echo "qcb${1}br"; }
host_veth() { echo "qcb${1}h${2}"; }

# Bytes for a tc size such as 256kb, 1mb, 300000 (tc's units: kb = 1024 bytes, k/kbit = bits).
size_bytes() {
    local v=$1 num unit
    num=${v%%[a-zA-Z]*}
    unit=${v#"$num"}
    case "$unit" in
    "" | b) echo "$num" ;;
    kb | k) echo $((num * 1024)) ;;
    mb | m) echo $((num * 1024 * 1024)) ;;
    *) die "cannot read size '$v' (use e.g. 256kb, 1mb or bytes)" ;;
    esac
}

check_id() {
    [[ "$1" =~ ^[a-z0-9]{1,6}$ ]] || die "--id must be 1-6 characters [a-z0-9] (interface names" \
        "are limited to 15 characters), got '$1'"
}

# Bits per second of a tc rate such as 100mbit or 1gbit.
rate_bits() {
    local v=$1 num unit
    num=${v%%[a-z]*}
    unit=${v#"$num"}
    case "$unit" in
    bit) echo "$num" ;;
    kbit) echo $((num * 1000)) ;;
    mbit) echo $((num * 1000000)) ;;
    gbit) echo $((num * 1000000000)) ;;
    *) die "cannot read rate '$v'" ;;
    esac
}

# The delayline binary, built from delayline.c next to this script when missing or older.
delayline_bin() {
    local src bin
    src="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/delayline.c"
    bin="$STATE_DIR/delayline"
    if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ]; then
        command -v gcc >/dev/null || die "--delay-ms needs gcc to build delayline.c"
        gcc -O2 -Wall -o "$bin.tmp" "$src" || die "building delayline.c failed"
        mv "$bin.tmp" "$bin"
    fi
    echo "$bin"
}

cmd_up() {
    local id="" nodes="" rate="" burst=256kb owner=$PPID delay="" open="" open0="" nat=""
    while [ $# -gt 0 ]; do
        case "$1" in
        --id) id=$2; shift 2 ;;
        --nodes) nodes=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --burst) burst=$2; shift 2 ;;
        --owner) owner=$2; shift 2 ;;
        --delay-ms) delay=$2; shift 2 ;;
        --firewall) open=$2; shift 2 ;;
        --firewall0) open0=$2; shift 2 ;;
        --nat-node) nat=$2; shift 2 ;;
        *) die "up: unknown argument '$1'" ;;
        esac
    done
    check_ports --firewall "$open"
    check_ports --firewall0 "$open0"
    [ -z "$open0" ] || [ -n "$open" ] || die "--firewall0 goes with --firewall (node 0's ports besides every node's)"
    [ -z "$nat" ] || { [[ "$nat" =~ ^[0-9]+$ ]] && [ "$nat" -lt "${nodes:-0}" ]; } ||
        die "--nat-node must be an integer in [0, nodes), got '$nat'"
    [ -z "$delay" ] || [[ "$delay" =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
        die "--delay-ms must be a number of milliseconds >= 0, got '$delay'"
    check_id "$id"
    [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 32 ] ||
        die "--nodes must be an integer in [1, 32], got '$nodes'"
    [[ "$rate" =~ ^[0-9]+(bit|kbit|mbit|gbit)$ ]] || die "--rate must look like 100mbit or 1gbit, got '$rate'"
    [ "$(size_bytes "$burst")" -ge $MIN_BURST_BYTES ] ||
        die "--burst must be >= 256kb (a burst under MTU+14 silently drops every packet), got '$burst'"
    [ -e "/run/netns/$(ns_name "$id" 0)" ] && die "a cluster with id '$id' exists already"

    # The owner file comes first, so `clean` of a concurrent run never mistakes a cluster being
    # built for an orphan.
    mkdir -p "$STATE_DIR"
    echo "$owner" >"$STATE_DIR/$id.owner"
    echo "$nodes" >"$STATE_DIR/$id.nodes"

    if [ -n "$delay" ]; then
        up_delayed "$id" "$nodes" "$rate" "$burst" "$delay"
    else
        up_bridged "$id" "$nodes" "$rate" "$burst"
    fi
    if [ -n "$open" ] || [ -n "$nat" ]; then
        echo "$open" >"$STATE_DIR/$id.firewall"
        echo "$open0" >"$STATE_DIR/$id.firewall0"
        echo "$nat" >"$STATE_DIR/$id.nat"
        local k ports
        for ((k = 0; k < nodes; k++)); do
            ports=$open
            [ "$k" != 0 ] || [ -z "$open0" ] || ports="$open,$open0"
            if [ "$k" = "$nat" ]; then
                firewall_node "$(ns_name "$id" "$k")" ""
            elif [ -n "$open" ]; then
                firewall_node "$(ns_name "$id" "$k")" "$ports"
            fi
        done
    fi
}

# A comma list of TCP ports (each in [1, 65535]), or nothing; $1 names the flag.
check_ports() {
    local p
    [ -z "$2" ] && return 0
    [[ "$2" =~ ^[0-9]+(,[0-9]+)*$ ]] || die "$1 must be a comma list of TCP ports, got '$2'"
    for p in ${2//,/ }; do
        [ "$p" -ge 1 ] && [ "$p" -le 65535 ] || die "$1: port $p is not in [1, 65535]"
    done
}

# Node namespace $1's firewall (see the header): a new TCP connection in through qceth0 only on
# the ports of the comma list $2 (empty: none, the NAT node).
firewall_node() {
    local ns=$1 ports=$2 p prio=1
    ip -n "$ns" link add qcfwsink type veth peer name qcfwpeer
    ip -n "$ns" link set qcfwsink up # its peer stays down: what is sent here is dropped
    ip netns exec "$ns" tc qdisc add dev "$IFACE" handle ffff: ingress
    for p in ${ports//,/ }; do
        # A match without an action ends the filter chain with the packet let through.
        ip netns exec "$ns" tc filter add dev "$IFACE" parent ffff: prio "$prio" protocol ip \
            u32 match ip protocol 6 0xff match ip dport "$p" 0xffff classid ffff:1
        prio=$((prio + 1))
    done
    # Any other SYN without ACK (the TCP flags, byte 13 of a 20-byte-header IP packet's TCP
    # header): a connection opened from outside, dropped.
    ip netns exec "$ns" tc filter add dev "$IFACE" parent ffff: prio "$prio" protocol ip \
        u32 match ip protocol 6 0xff match u8 0x02 0x12 at 33 \
        action mirred egress redirect dev qcfwsink
}

# The bridged nodes (see the header): veth pairs joined by one bridge, tbf on both ends.
up_bridged() {
    local id=$1 nodes=$2 rate=$3 burst=$4
    local br k ns hv
    br=$(br_name "$id")
    ip link add name "$br" type bridge
    echo 1 >"/proc/sys/net/ipv6/conf/$br/disable_ipv6" # no router solicitations in the counters
    ip link set "$br" up
    for ((k = 0; k < nodes; k++)); do
        ns=$(ns_name "$id" "$k")
        hv=$(host_veth "$id" "$k")
        ip netns add "$ns"
        ip link add "$hv" type veth peer name "qcb${id}p${k}"
        ip link set "qcb${id}p${k}" netns "$ns"
        ip -n "$ns" link set "qcb${id}p${k}" name "$IFACE"
        ip netns exec "$ns" sysctl -qw "net.ipv6.conf.$IFACE.disable_ipv6=1"
        ip -n "$ns" addr add "$SUBNET.$((k + 1))/24" dev "$IFACE"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$IFACE" up
        echo 1 >"/proc/sys/net/ipv6/conf/$hv/disable_ipv6"
        ip link set "$hv" master "$br"
        ip link set "$hv" up
        # latency bounds the queue (rate * latency bytes); 100 ms holds a few TCP windows.
        ip netns exec "$ns" tc qdisc replace dev "$IFACE" root tbf rate "$rate" burst "$burst" latency 100ms
        tc qdisc replace dev "$hv" root tbf rate "$rate" burst "$burst" latency 100ms
    done
}

# The nodes joined by delayline (see the header): TUN devices qcd<ID>t<k> made by the forwarder
# in the root namespace, each moved into its node's namespace as qceth0.
up_delayed() {
    local id=$1 nodes=$2 rate=$3 burst=$4 delay=$5 bin k ns dev
    bin=$(delayline_bin)
    local -a names=()
    for ((k = 0; k < nodes; k++)); do
        names+=("qcd${id}t${k}")
    done
    local ready="$STATE_DIR/$id.delayline.out"
    "$bin" --delay-ms "$delay" --rate "$(rate_bits "$rate")" --subnet "$SUBNET" "${names[@]}" \
        >"$ready" 2>"$STATE_DIR/$id.delayline.log" &
    echo $! >"$STATE_DIR/$id.delayline"
    for ((k = 0; k < 100; k++)); do
        grep -q ready "$ready" 2>/dev/null && break
        kill -0 "$(cat "$STATE_DIR/$id.delayline")" 2>/dev/null ||
            die "delayline exited: $(cat "$STATE_DIR/$id.delayline.log")"
        sleep 0.05
    done
    grep -q ready "$ready" || die "delayline did not start within 5 s"
    for ((k = 0; k < nodes; k++)); do
        ns=$(ns_name "$id" "$k")
        dev=${names[$k]}
        ip netns add "$ns"
        ip link set "$dev" netns "$ns"
        ip -n "$ns" link set "$dev" name "$IFACE"
        ip netns exec "$ns" sysctl -qw "net.ipv6.conf.$IFACE.disable_ipv6=1" 2>/dev/null || true
        ip -n "$ns" link set "$IFACE" mtu 65000
        ip -n "$ns" addr add "$SUBNET.$((k + 1))/24" dev "$IFACE"
        ip -n "$ns" link set lo up
        ip -n "$ns" link set "$IFACE" up
        # Windows for a long fat link: 32 MB, the most Gloo asks for (50 ms at 1 Gbit/s is a
        # 12.5 MB round trip).
        ip netns exec "$ns" sysctl -qw net.ipv4.tcp_rmem="4096 131072 33554432" \
            net.ipv4.tcp_wmem="4096 16384 33554432" 2>/dev/null || true
        ip netns exec "$ns" tc qdisc replace dev "$IFACE" root tbf rate "$rate" burst "$burst" \
            latency 100ms
    done
}

cmd_down() {
    local id=""
    while [ $# -gt 0 ]; do
        case "$1" in
        --id) id=$2; shift 2 ;;
        *) die "down: unknown argument '$1'" ;;
        esac
    done
    check_id "$id"
    local ns k
    # Namespaces: every qcb<id>n<k> there is, not only the ones the state file names, so a
    # half-built cluster goes too. Deleting a namespace deletes its veth end and the peer with it.
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^qcb${id}n[0-9]+$" || true); do
        # Stop anything still running in the namespace (processes this cluster started).
        for k in $(ip netns pids "$ns" 2>/dev/null || true); do
            kill -TERM "$k" 2>/dev/null || true
        done
        ip netns del "$ns" 2>/dev/null || true
    done
    ip link del "$(br_name "$id")" 2>/dev/null || true
    if [ -e "$STATE_DIR/$id.delayline" ]; then
        kill -TERM "$(cat "$STATE_DIR/$id.delayline")" 2>/dev/null || true
        rm -f "$STATE_DIR/$id.delayline" "$STATE_DIR/$id.delayline.out" \
            "$STATE_DIR/$id.delayline.log"
    fi
    # Slow nodes' CPU cgroups a killed launch left behind.
    for ns in /sys/fs/cgroup/cpu/qcb"${id}"n* /sys/fs/cgroup/qcb"${id}"n*; do
        [ -d "$ns" ] && remove_cgroup "$ns"
    done
    rm -f "$STATE_DIR/$id.owner" "$STATE_DIR/$id.nodes" "$STATE_DIR/$id.firewall" \
        "$STATE_DIR/$id.firewall0" "$STATE_DIR/$id.nat"
}

cmd_clean() {
    local f id owner ns
    mkdir -p "$STATE_DIR"
    for f in "$STATE_DIR"/*.owner; do
        [ -e "$f" ] || continue
        id=$(basename "$f" .owner)
        owner=$(cat "$f" 2>/dev/null || echo 0)
        if ! kill -0 "$owner" 2>/dev/null; then
            echo "netns.sh: removing stale cluster '$id' (owner $owner is gone)" >&2
            cmd_down --id "$id"
        fi
    done
    # Namespaces of our naming scheme without an owner file are left-overs of a crashed run.
    for ns in $(ip netns list | awk '{print $1}' | grep -E '^qcb[a-z0-9]{1,6}n[0-9]+$' || true); do
        id=${ns#qcb}
        id=${id%n*}
        if [ ! -e "$STATE_DIR/$id.owner" ]; then
            echo "netns.sh: removing orphan cluster '$id'" >&2
            cmd_down --id "$id"
        fi
    done
}

cmd_counters() {
    local id="" nodes="" k ns
    while [ $# -gt 0 ]; do
        case "$1" in
        --id) id=$2; shift 2 ;;
        --nodes) nodes=$2; shift 2 ;;
        *) die "counters: unknown argument '$1'" ;;
        esac
    done
    check_id "$id"
    for ((k = 0; k < nodes; k++)); do
        ns=$(ns_name "$id" "$k")
        echo "$k $(ip netns exec "$ns" cat "/sys/class/net/$IFACE/statistics/tx_bytes")" \
            "$(ip netns exec "$ns" cat "/sys/class/net/$IFACE/statistics/rx_bytes")"
    done
}

# One torchrun per node inside its namespace, each under `timeout`. Node 0's output goes to
# stdout (the workload's progress lines; the caller keeps it), the others' to DIR/node<k>.log. The first node that
# fails stops the others; the exit status is the first failure's (124: a timeout).
# The CPU cgroup directory of node k of cluster ID (cgroup v1's cpu hierarchy, or v2).
cpu_cgroup() {
    if [ -e /sys/fs/cgroup/cpu/cpu.cfs_quota_us ]; then
        echo "/sys/fs/cgroup/cpu/qcb${1}n${2}"
    elif [ -e /sys/fs/cgroup/cgroup.controllers ]; then
        echo "/sys/fs/cgroup/qcb${1}n${2}"
    else
        die "no CPU cgroup controller found (neither /sys/fs/cgroup/cpu nor cgroup v2)"
    fi
}

# Create node k's cgroup with a quota of NUM/DEN cores (a 10 ms period).
make_slow_cgroup() {
    local dir=$1 num=$2 den=$3 period=10000 quota
    quota=$((period * num / den))
    mkdir -p "$dir"
    if [ -e "$dir/cpu.cfs_quota_us" ]; then
        echo "$period" >"$dir/cpu.cfs_period_us"
        echo "$quota" >"$dir/cpu.cfs_quota_us"
    else
        echo "+cpu" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
        echo "$quota $period" >"$dir/cpu.max"
    fi
}

remove_cgroup() {
    local dir=$1 p
    [ -d "$dir" ] || return 0
    for p in $(cat "$dir/cgroup.procs" 2>/dev/null || true); do
        kill -KILL "$p" 2>/dev/null || true
    done
    rmdir "$dir" 2>/dev/null || true
}

# The first child of process $1 (empty when it has none).
child_of() { pgrep -P "$1" | head -n 1 || true; }

# After a planned node loss: wait until none of the launchers $2... (timeout -> torchrun ->
# workers) has a worker left, give the agents 3 s to end by themselves, then SIGKILL the
# torchrun agents still there (waiting in torchrun's exit barrier for the lost node's agent),
# listing their launchers in file $1 first.
reap_survivors() {
    local list=$1 p t busy
    shift
    while :; do
        busy=0
        for p in "$@"; do
            t=$(child_of "$p")
            if [ -n "$t" ] && [ -n "$(child_of "$t")" ]; then
                busy=1
            fi
        done
        [ "$busy" -eq 0 ] && break
        sleep 0.5
    done
    sleep 3
    for p in "$@"; do
        t=$(child_of "$p")
        [ -n "$t" ] || continue
        echo "$p" >>"$list"
        kill -KILL "$t" 2>/dev/null || true
    done
}

cmd_launch() {
    local id="" nodes="" procs="" tmo=600 port="" logdir="" slow=0 slowdown=1 lost="" equal=0
    local linked=0 restart="" elastic=0 rejoin_file="" listen=""
    while [ $# -gt 0 ]; do
        case "$1" in
        --id) id=$2; shift 2 ;;
        --nodes) nodes=$2; shift 2 ;;
        --procs) procs=$2; shift 2 ;;
        --timeout) tmo=$2; shift 2 ;;
        --port) port=$2; shift 2 ;;
        --logdir) logdir=$2; shift 2 ;;
        --slow-nodes) slow=$2; shift 2 ;;
        --slowdown) slowdown=$2; shift 2 ;;
        --lost-node) lost=$2; shift 2 ;;
        --equal-cpu) equal=1; shift ;;
        --linked) linked=1; shift ;;
        --restart-node) restart=$2; shift 2 ;;
        --elastic) elastic=1; shift ;;
        --rejoin-file) rejoin_file=$2; shift 2 ;;
        --listen) listen=$2; shift 2 ;;
        --) shift; break ;;
        *) die "launch: unknown argument '$1'" ;;
        esac
    done
    [ -z "$lost" ] || { [[ "$lost" =~ ^[0-9]+$ ]] && [ "$lost" -ge 1 ] && [ "$lost" -lt "${nodes:-0}" ]; } ||
        die "--lost-node must be an integer in [1, nodes) (node 0 hosts the rendezvous store), got '$lost'"
    [ -z "$restart" ] || { [ "$((linked + elastic))" = 1 ] && [[ "$restart" =~ ^[0-9]+$ ]] && [ "$restart" -ge 1 ] && [ "$restart" -lt "${nodes:-0}" ]; } ||
        die "--restart-node needs --linked or --elastic and an integer in [1, nodes) (node 0 hosts the rendezvous), got '$restart'"
    [ "$elastic" = 0 ] || { [ -n "$restart" ] && [ -n "$rejoin_file" ] && [ "$linked" = 0 ]; } ||
        die "--elastic needs --restart-node K and --rejoin-file F (and not --linked)"
    [ -z "$rejoin_file" ] || { [ "$((linked + elastic))" = 1 ] && [ -n "$restart" ]; } ||
        die "--rejoin-file goes with --elastic or --linked, and --restart-node"
    [[ "$slow" =~ ^[0-9]+$ ]] && [ "$slow" -lt "${nodes:-0}" ] ||
        die "--slow-nodes must be an integer in [0, nodes) (one node at least stays fast), got '$slow'"
    [[ "$slowdown" =~ ^[0-9]+(\.[0-9]+)?$ ]] ||
        die "--slowdown must be a number >= 1 (2: half speed), got '$slowdown'"
    # Integer arithmetic in thousandths: slowdown S -> S1000.
    local s1000
    s1000=$(awk -v s="$slowdown" 'BEGIN { printf "%d", s * 1000 + 0.5 }')
    [ "$s1000" -ge 1000 ] || die "--slowdown must be >= 1, got '$slowdown'"
    check_id "$id"
    [ $# -ge 1 ] || die "launch: give the training script after --"
    [[ "$procs" =~ ^[0-9]+$ ]] && [ "$procs" -ge 1 ] || die "--procs must be a positive integer"
    [ -z "$listen" ] || { [ "$linked" = 1 ] && [[ "$listen" =~ ^[0-9]+$ ]] && [ "$listen" -ge 1 ] && [ "$listen" -le 65535 ]; } ||
        die "--listen goes with --linked and takes a TCP port in [1, 65535], got '$listen'"
    # The NAT node (dials every link) and node 0's open ports, from the up's firewall.
    local nat="" open0=""
    [ ! -e "$STATE_DIR/$id.nat" ] || nat=$(cat "$STATE_DIR/$id.nat")
    [ ! -e "$STATE_DIR/$id.firewall0" ] || open0=$(cat "$STATE_DIR/$id.firewall0")
    [ -n "$port" ] || port=${open0%%,*}
    [ -n "$port" ] || port=$((20000 + RANDOM % 20000))
    [ -n "$logdir" ] || logdir=$(mktemp -d /tmp/qcb-logs.XXXXXX)
    mkdir -p "$logdir"
    local torchrun=${TORCHRUN:-$(command -v torchrun || true)}
    [ -n "$torchrun" ] || die "torchrun not found (activate the venv or set TORCHRUN)"

    local -a pids=() cgroups=()
    local k ns cores lost_pid="" reaper="" reaped="$logdir/reaped-launchers" rdzv_pid=""
    if [ "$linked" = 1 ]; then
        # The job's rendezvous, beside node 0 (in its namespace: the nodes reach it over their
        # links) and apart from it: a process of its own, stopped when the launch ends.
        local py=${PYTHON:-$(dirname "$torchrun")/python}
        [ -x "$py" ] || py=python3
        ip netns exec "$(ns_name "$id" 0)" "$py" -m qcomm.rendezvous --host "$SUBNET.1" \
            --port "$port" --nodes "$nodes" >"$logdir/rendezvous.log" 2>&1 &
        rdzv_pid=$!
    fi
    rm -f "$reaped"
    touch "$reaped"
    cores=$(nproc)
    for ((k = 0; k < nodes; k++)); do
        ns=$(ns_name "$id" "$k")
        [ -e "/run/netns/$ns" ] || die "launch: namespace $ns does not exist (run 'up' first)"
        local -a wrap=()
        if [ "$slow" -gt 0 ] && [ "$k" -ge $((nodes - slow)) ] && [ "$s1000" -gt 1000 ]; then
            local cg
            cg=$(cpu_cgroup "$id" "$k")
            # P f / S cores, f = min(1, C / ((N-K) P + K P / S)); in thousandths of S:
            # saturated, P C / (S ((N-K) P + K P / S)) = C 1000 / ((N-K) S1000 + K 1000).
            local busy=$(((nodes - slow) * procs * s1000 + slow * procs * 1000))
            if [ "$equal" = 1 ]; then
                # Machines of their own: C / N cores a node, a slow one 1/S of that.
                make_slow_cgroup "$cg" $((cores * 1000)) $((nodes * s1000))
            elif [ $((cores * s1000)) -ge "$busy" ]; then
                make_slow_cgroup "$cg" $((procs * 1000)) "$s1000"   # f = 1: P / S cores
            else
                make_slow_cgroup "$cg" $((cores * 1000)) $(((nodes - slow) * s1000 + slow * 1000))
            fi
            cgroups+=("$cg")
            # The shell joins the cgroup, then becomes the node's launcher: everything the node
            # starts inherits the cap.
            wrap=(bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg")
        elif [ "$equal" = 1 ]; then
            # Identical machines: every node capped at cores / nodes, so that no node's
            # processes take another's share of the shared cores.
            local cg
            cg=$(cpu_cgroup "$id" "$k")
            make_slow_cgroup "$cg" "$cores" "$nodes"
            cgroups+=("$cg")
            wrap=(bash -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cg")
        fi
        local -a world=(--nnodes "$nodes" --node-rank "$k" --master-addr "$SUBNET.1"
            --master-port "$port" --max-restarts 0)
        local -a linked_env=()
        if [ "$elastic" = 1 ]; then
            local host=0
            [ "$k" != 0 ] || host=1
            # --local-addr: the agent publishes its node's address to the others (its host
            # name resolves to loopback in the namespace).
            world=(--nnodes "$((nodes - 1)):$nodes" --rdzv-backend c10d --local-addr "$SUBNET.$((k + 1))"
                --rdzv-endpoint "$SUBNET.1:$port" --rdzv-id "qcb$id" --max-restarts 3
                --rdzv-conf "is_host=$host,join_timeout=120,last_call_timeout=2,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3")
            # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the shared store (the default), an agent
            # publishes the workers' store address in the first round only, so a node that
            # joins a later round waits for it forever (torch 2.13); per-round publishing works.
            linked_env=(QCB_NODE="$k" QCB_NODES="$nodes" TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)
        fi
        if [ "$linked" = 1 ]; then
            # Linked nodes: each torchrun's world is its node; node --restart-node's agent
            # starts its ranks once more after they are killed.
            world=(--standalone --nnodes 1 --max-restarts $([ "$k" = "$restart" ] && [ -z "$rejoin_file" ] && echo 1 || echo 0))
            linked_env=(QCOMM_RENDEZVOUS="$SUBNET.1:$port" QCB_NODE="$k" QCB_NODES="$nodes")
            if [ -n "$listen" ] && [ "$k" != "$nat" ]; then
                linked_env+=(QCOMM_LISTEN="$SUBNET.$((k + 1)):$listen")
            fi
        fi
        local -a cmd=("${wrap[@]}" ip netns exec "$ns" env GLOO_SOCKET_IFNAME="$IFACE" OMP_NUM_THREADS=1
            QCB_IFACE="$IFACE" QCB_KILLED_AT="$(($(date +%s) + tmo))" "${linked_env[@]}" timeout --kill-after=15 "$tmo"
            "$torchrun" "${world[@]}" --nproc-per-node "$procs" --monitor-interval 0.5 "$@")
        # `ip netns exec`, env and timeout each exec the next, so $! is timeout's pid and a TERM
        # sent to it reaches torchrun, which passes it on to its workers.
        if [ "$k" -eq 0 ]; then
            "${cmd[@]}" &
        elif [ -n "$rejoin_file" ] && [ "$k" = "$restart" ]; then
            # The node's machine: its torchrun, killed by the script; then started again at
            # the time the rejoin file names (an operator's restart).
            (
                "${cmd[@]}" || true
                until [ -s "$rejoin_file" ]; do sleep 0.1; done
                at=$(grep -oE '[0-9]+(\.[0-9]+)?' "$rejoin_file" | head -n 1)
                wait_s=$(awk -v t="$at" -v now="$(date +%s.%N)" 'BEGIN { d = t - now; print (d > 0 ? d : 0) }')
                sleep "$wait_s"
                echo "netns.sh: node $k's torchrun started again" >&2
                exec "${cmd[@]}"
            ) >"$logdir/node$k.log" 2>&1 &
        else
            "${cmd[@]}" >"$logdir/node$k.log" 2>&1 &
        fi
        pids+=($!)
        [ "$k" != "$lost" ] || lost_pid=$!
    done

    # Stopped ourselves (the driver's timeout, Ctrl-C): stop the nodes too, not leave them be.
    # shellcheck disable=SC2317  # reached through the trap
    stop_nodes() {
        local p
        for p in "${pids[@]}"; do
            kill -TERM "$p" 2>/dev/null || true
        done
        sleep 1
        for p in "${cgroups[@]}"; do
            remove_cgroup "$p"
        done
        [ -z "$rdzv_pid" ] || kill "$rdzv_pid" 2>/dev/null || true
        exit 143
    }
    trap stop_nodes TERM INT
    # Wait for whichever node ends first; a failure stops the rest. `wait -n` must only be given
    # pids still running, so finished ones leave the list.
    local rc=0 done_pid status
    local -a left
    # While the nodes run, bash's notices of jobs killed by SIGKILL ("line N: PID Killed ...":
    # a lost node, or an agent stopped by reap_survivors; printed whenever bash reaps the job)
    # are filtered out of stderr; everything else passes. Our messages go to fd 3 (stderr).
    exec 3>&2 2> >(grep --line-buffered -v -E ': line [0-9]+: +[0-9]+ Killed ' >&3)
    while [ "${#pids[@]}" -gt 0 ]; do
        status=0
        done_pid=""
        wait -n -p done_pid "${pids[@]}" || status=$?
        if [ -z "${done_pid:-}" ]; then
            # "no such job": bash already dropped a finished one (two nodes ending together);
            # find it, and its status is still there for a plain `wait`.
            for k in "${pids[@]}"; do
                if ! kill -0 "$k" 2>/dev/null; then
                    done_pid=$k
                    status=0
                    wait "$k" 2>/dev/null || status=$?
                    break
                fi
            done
            [ -n "$done_pid" ] || { sleep 0.2; continue; }
        fi
        left=()
        for k in "${pids[@]}"; do
            [ "$k" = "$done_pid" ] || left+=("$k")
        done
        pids=("${left[@]}")
        if [ -n "$lost_pid" ] && [ "$done_pid" = "$lost_pid" ]; then
            echo "netns.sh: node $lost ended with status $status (its planned loss);" \
                "the other nodes go on" >&3
            if [ "${#pids[@]}" -gt 0 ]; then
                reap_survivors "$reaped" "${pids[@]}" &
                reaper=$!
            fi
            continue
        fi
        if grep -qx "$done_pid" "$reaped"; then
            continue # its workers had ended; its agent was left in torchrun's exit barrier
        fi
        if [ "$status" -ne 0 ] && [ "$rc" -eq 0 ]; then
            rc=$status
            echo "netns.sh: a node exited with status $status; stopping the others" >&3
            for k in "${pids[@]}"; do
                kill -TERM "$k" 2>/dev/null || true
            done
        fi
    done
    if [ -n "$reaper" ]; then
        kill "$reaper" 2>/dev/null || true
        wait "$reaper" 2>/dev/null || true
    fi
    exec 2>&3 3>&-
    if [ -n "$rdzv_pid" ]; then
        kill "$rdzv_pid" 2>/dev/null || true
        wait "$rdzv_pid" 2>/dev/null || true
    fi
    rm -f "$reaped"
    for k in "${cgroups[@]}"; do
        remove_cgroup "$k"
    done
    if [ "$rc" -ne 0 ]; then
        for ((k = 1; k < nodes; k++)); do
            echo "---- node $k log tail ($logdir/node$k.log) ----" >&2
            tail -n 25 "$logdir/node$k.log" >&2 || true
        done
    fi
    trap - TERM INT
    return "$rc"
}

cmd_run() {
    local nodes="" procs="" rate="" tmo=600 burst=256kb
    local -a rest=()
    while [ $# -gt 0 ]; do
        case "$1" in
        --nodes) nodes=$2; shift 2 ;;
        --procs) procs=$2; shift 2 ;;
        --rate) rate=$2; shift 2 ;;
        --burst) burst=$2; shift 2 ;;
        --timeout) tmo=$2; shift 2 ;;
        --) shift; rest=("$@"); break ;;
        *) die "run: unknown argument '$1'" ;;
        esac
    done
    local id
    id=$(printf '%04x' $((RANDOM % 65536)))
    cmd_clean
    # shellcheck disable=SC2064  # expand $id now: the trap must remove this cluster
    trap "cmd_down --id $id" EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    cmd_up --id "$id" --nodes "$nodes" --rate "$rate" --burst "$burst" --owner $$
    cmd_launch --id "$id" --nodes "$nodes" --procs "$procs" --timeout "$tmo" -- "${rest[@]}"
}

main() {
    [ $# -ge 1 ] || die "usage: netns.sh up|launch|counters|down|clean|run ... (see the header)"
    local sub=$1
    shift
    case "$sub" in
    -h | --help | help)
        sed -n '2,/^set -euo/p' "$0" | sed '$d'
        exit 0
        ;;
    esac
    require_root
    case "$sub" in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    clean) cmd_clean ;;
    counters) cmd_counters "$@" ;;
    launch) cmd_launch "$@" ;;
    run) cmd_run "$@" ;;
    *) die "unknown command '$sub' (up, launch, counters, down, clean, run)" ;;
    esac
}

main "$@"
