#!/bin/sh
# PID 1 of dmkv's Soft-RoCE test VM (the whole root filesystem lives in the initramfs).
#
# Mounts the 9p shares "ctl" (control dir: cmd.sh in, rc out) at /ctl and "host" (the directory
# run.sh shares) at /host, brings up the netdev, creates the Soft-RoCE device rxe0 on it, runs
# /ctl/cmd.sh with bash, writes its exit code to /ctl/rc and powers off.
# The command's output goes to the second UART (/dev/ttyS1 = run.sh's stdout); this script's
# own log goes to the console (/dev/ttyS0 = a log file on the host).
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH HOME=/root TERM=dumb LANG=C.UTF-8
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm /tmp /run /host /ctl
mount -t devpts devpts /dev/pts
mount -t tmpfs tmpfs /dev/shm
mount -t tmpfs tmpfs /run
chmod 1777 /tmp
ln -sf /proc/self/fd /dev/fd 2>/dev/null

# sysrq power-off never returns control to a shell that could exit (exiting PID 1 panics).
poweroff_now() { sync; echo o > /proc/sysrq-trigger; sleep 30; }
log() { echo "dmkv-vm: $*"; }
log "init started at uptime $(cut -d' ' -f1 /proc/uptime)s"

NET=eth0
for a in $(cat /proc/cmdline); do
  case "$a" in dmkv.net=*) NET=${a#dmkv.net=} ;; esac
done

for m in virtio_pci 9pnet_virtio 9p virtio_net; do modprobe "$m" || log "modprobe $m failed"; done
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=none ctl /ctl || { log "cannot mount ctl"; poweroff_now; }
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose host /host || log "cannot mount the host share"

hostname dmkv-vm 2>/dev/null
ip link set lo up
# Router advertisements would add SLAAC addresses and with them extra GIDs; a fixed table
# (GID 0 = fe80:: link-local, GID 1 = ::ffff:10.0.2.15) keeps test runs reproducible.
for f in /proc/sys/net/ipv6/conf/*/accept_ra; do echo 0 > "$f"; done 2>/dev/null
case "$NET" in
  eth0) ip addr add 10.0.2.15/24 dev eth0 && ip link set eth0 up ;;
  dummy*) modprobe dummy numdummies=0 && ip link add "$NET" type dummy \
            && ip addr add 10.0.2.15/24 dev "$NET" && ip link set "$NET" up ;;
  *) log "unknown dmkv.net=$NET" ;;
esac
modprobe crc32_pclmul 2>/dev/null
modprobe crc32_generic
modprobe rdma_rxe && modprobe ib_uverbs && modprobe rdma_ucm || log "loading the rdma modules failed"
rdma link add rxe0 type rxe netdev "$NET" || log "rdma link add rxe0 failed"
# The port turns ACTIVE asynchronously; tests that open the device first must not race it (<= 5 s).
i=0
while [ $i -lt 50 ]; do
  grep -q ACTIVE /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null && break
  sleep 0.1; i=$((i + 1))
done
log "rxe0 port 1: $(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)"
# Memory registration pins pages; the default 8 MiB memlock limit is far too small for a region.
ulimit -l unlimited 2>/dev/null

stty -F /dev/ttyS1 raw -echo 2>/dev/null
log "running /ctl/cmd.sh at uptime $(cut -d' ' -f1 /proc/uptime)s"
bash /ctl/cmd.sh > /dev/ttyS1 2>&1 < /dev/null
rc=$?
log "exit code $rc"
echo "$rc" > /ctl/rc
poweroff_now
