#!/bin/bash
# A three-node Slurm on this host for `pytest -m slurm tests/launch` (Debian 12's slurm-wlm 22.05).
#
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge   # once, as root
#   tests/launch/local_slurm.sh start [DIR]    # prints the SLURM_CONF to export
#   SLURM_CONF=DIR/slurm.conf python -m pytest -m slurm tests/launch
#   tests/launch/local_slurm.sh stop [DIR]
#
# Nodes tir-n1..tir-n3 are three slurmd on this host (2 CPUs, 2 GPUs each; the GPUs are
# empty files, so steps see no CUDA device); their names go to /etc/hosts (127.0.0.1).
set -euo pipefail
cmd=${1:-start}
dir=${2:-/tmp/tir-slurm}
conf=$dir/slurm.conf

stop() {
    for f in "$dir"/pid.*; do
        [ -e "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
        rm -f "$f"
    done
}

if [ "$cmd" = stop ]; then stop; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "local_slurm.sh: run as root (slurmd)" >&2; exit 2; }
command -v slurmctld >/dev/null || { echo "local_slurm.sh: install slurmctld slurmd slurm-client munge" >&2; exit 2; }
stop
mkdir -p "$dir"/{state,spool,log}
rm -rf "$dir"/state/* "$dir"/spool/*
host=$(hostname)
cat > "$conf" <<EOF
ClusterName=tir
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
SlurmUser=root
ReturnToService=2
MpiDefault=none
SlurmctldPort=16817
SlurmdPort=16818
NodeName=tir-n[1-3] NodeHostname=$host CPUs=2 RealMemory=4000 Gres=gpu:2 State=UNKNOWN Port=17001-17003
PartitionName=batch Nodes=tir-n[1-3] Default=YES MaxTime=INFINITE State=UP
EOF
touch "$dir"/fakegpu0 "$dir"/fakegpu1
echo "NodeName=tir-n[1-3] Name=gpu File=$dir/fakegpu[0-1]" > "$dir/gres.conf"
grep -q "tir-n1" /etc/hosts || echo "127.0.0.1 tir-n1 tir-n2 tir-n3  # tests/launch/local_slurm.sh" >> /etc/hosts
if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge
    su -s /bin/sh munge -c /usr/sbin/munged
fi
export SLURM_CONF=$conf
setsid slurmctld -D -f "$conf" > "$dir/log/slurmctld.out" 2>&1 & echo $! > "$dir/pid.slurmctld"
for n in tir-n1 tir-n2 tir-n3; do
    setsid slurmd -D -N "$n" -f "$conf" > "$dir/log/slurmd-$n.out" 2>&1 & echo $! > "$dir/pid.slurmd-$n"
done
for _ in $(seq 30); do
    [ "$(sinfo -h -p batch -t idle -o %D 2>/dev/null)" = 3 ] && { echo "export SLURM_CONF=$conf"; exit 0; }
    sleep 1
done
echo "local_slurm.sh: the nodes did not come up; see $dir/log/" >&2
exit 1
