#!/bin/bash
# Boot a throwaway QEMU VM with a Soft-RoCE device (rxe0), run one command in it, return its exit code.
#
# Usage: run.sh [-C DIR] [-t SECS] [-m MB] [-c CPUS] [-e NAME=VALUE]... [--] CMD [ARGS...]
#   -C DIR         host directory shared read-write at /host in the guest; CMD runs there
#                  (default: the current directory). Give binaries as paths relative to DIR.
#   -t SECS        wall-clock limit for the whole VM (default 600); exit 124 when hit
#   -m MB          guest memory (default 2048)      -c CPUS   guest vCPUs (default 2)
#   -e NAME=VALUE  environment variable for CMD (repeatable)
# Env: DMKV_RDMA_VM_CACHE  image cache (default /var/cache/dmkv-rdma-vm; built on first use)
#      DMKV_RDMA_VM_NET    eth0 (default: virtio NIC, user networking, restrict=on) or dummy0
#      DMKV_RDMA_VM_ACCEL  kvm|tcg (default: kvm only with real VT-x/AMD-V, else tcg)
#      DMKV_RDMA_VM_CONSOLE=FILE  keep the guest console log there
# CMD's stdout and stderr (merged) go to this script's stdout. Exit status: CMD's, 124 on
# timeout, 125 if the VM ended without reporting one (the console tail is printed on stderr).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SHARE=$PWD; TMO=600; MEM=2048; CPUS=2; ENVS=()
while [ $# -gt 0 ]; do
  case "$1" in
    -C) SHARE=$(cd "$2" && pwd); shift 2 ;;
    -t) TMO=$2; shift 2 ;;
    -m) MEM=$2; shift 2 ;;
    -c) CPUS=$2; shift 2 ;;
    -e) [[ "$2" == [A-Za-z_]*=* ]] || { echo "run.sh: -e wants NAME=VALUE, got '$2'" >&2; exit 2; }
        ENVS+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "run.sh: unknown option $1 (see -h)" >&2; exit 2 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "run.sh: no command given (see -h)" >&2; exit 2; }

CACHE=${DMKV_RDMA_VM_CACHE:-/var/cache/dmkv-rdma-vm}
if [ ! -s "$CACHE/kernel" ] || [ ! -s "$CACHE/initramfs.cpio.zst" ] || ! command -v qemu-system-x86_64 >/dev/null; then
  "$HERE/build-image.sh" "$CACHE" >/dev/null
fi

# A /dev/kvm without hardware virtualization (e.g. a PVM-backed one: kvm_pvm loaded, no vmx/svm
# flag) cannot run a stock kernel, so only real VT-x/AMD-V gets KVM; TCG boots in a few seconds.
ACCEL=${DMKV_RDMA_VM_ACCEL:-}
if [ -z "$ACCEL" ]; then
  if [ -w /dev/kvm ] && [ ! -e /sys/module/kvm_pvm ] && grep -qw -E 'vmx|svm' /proc/cpuinfo; then
    ACCEL=kvm
  else
    ACCEL=tcg
  fi
fi
case "$ACCEL" in
  kvm) ACCELOPTS=(-accel kvm -cpu host) ;;
  tcg) ACCELOPTS=(-accel tcg -cpu max) ;;
  *) echo "run.sh: DMKV_RDMA_VM_ACCEL must be kvm or tcg" >&2; exit 2 ;;
esac

NET=${DMKV_RDMA_VM_NET:-eth0}
# restrict=on: the guest reaches nothing outside the VM; RoCE traffic to its own address stays inside.
if [ "$NET" = eth0 ]; then NIC=(-nic user,model=virtio-net-pci,restrict=on); else NIC=(); fi

CTL=$(mktemp -d /tmp/dmkv-rdma-vm.XXXXXX)
trap 'rm -rf "$CTL"' EXIT
{
  echo 'cd /host || exit 125'
  for e in "${ENVS[@]}"; do printf 'export %q\n' "$e"; done
  printf 'exec'; printf ' %q' "$@"; echo
} > "$CTL/cmd.sh"

set +e
timeout -k 5 "$TMO" qemu-system-x86_64 -nodefaults -no-user-config -display none -no-reboot \
  "${ACCELOPTS[@]}" -M q35 -smp "$CPUS" -m "$MEM" \
  -kernel "$CACHE/kernel" -initrd "$CACHE/initramfs.cpio.zst" \
  -append "console=ttyS0 panic=-1 quiet loglevel=4 dmkv.net=$NET" \
  -virtfs "local,path=$CTL,mount_tag=ctl,security_model=none" \
  -virtfs "local,path=$SHARE,mount_tag=host,security_model=none" \
  "${NIC[@]}" \
  -serial "file:$CTL/console.log" \
  -chardev stdio,id=out,signal=off -serial chardev:out < /dev/null
qrc=$?
set -e
[ -n "${DMKV_RDMA_VM_CONSOLE:-}" ] && cp "$CTL/console.log" "$DMKV_RDMA_VM_CONSOLE"
if [ -s "$CTL/rc" ]; then exit "$(cat "$CTL/rc")"; fi
echo "run.sh: the VM reported no exit status (qemu exit $qrc); end of the guest console:" >&2
tail -n 60 "$CTL/console.log" >&2 || true
[ "$qrc" = 124 ] && exit 124
exit 125
