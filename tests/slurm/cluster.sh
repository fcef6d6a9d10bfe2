#!/usr/bin/env bash
# A two-node Slurm cluster on this host, for the tests: one slurmctld, two slurmd (n1, n2) on
# 127.0.0.1 with their own ports. Usage: cluster.sh start DIR | cluster.sh stop DIR
set -euo pipefail
action=$1
dir=$2
conf=$dir/slurm.conf
if [ "$action" = stop ]; then
  SLURM_CONF=$conf scancel --full -u "$(id -un)" 2>/dev/null || true
  for pidfile in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  exit 0
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >/dev/null 2>&1
  fi
fi
command -v slurmctld >/dev/null || { echo "slurm-wlm is not installed and cannot be installed here" >&2; exit 3; }
for node in n1 n2; do grep -qE "[[:space:]]$node\$" /etc/hosts || echo "127.0.0.1 $node" >> /etc/hosts; done
mkdir -p "$dir/state" "$dir/spool/n1" "$dir/spool/n2" /etc/munge /run/munge /var/log/munge /var/lib/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
fi
pgrep -x munged >/dev/null || munged --force 2>/dev/null || true
user=$(id -un)
cat > "$conf" <<CONF
ClusterName=lockstep
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=17010
AuthType=auth/munge
CredType=cred/munge
SlurmUser=$user
SlurmdUser=$user
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
JobRequeue=1
NodeName=n1 NodeAddr=127.0.0.1 Port=17021 CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=17022 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
slurmctld -f "$conf"
slurmd -f "$conf" -N n1
slurmd -f "$conf" -N n2
for _ in $(seq 1 40); do
  if SLURM_CONF=$conf sinfo -h -o "%T" 2>/dev/null | grep -q idle; then exit 0; fi
  sleep 0.5
done
echo "the cluster did not come up; see $dir/*.log" >&2
exit 4
