#!/bin/bash
# Build (once) the kernel + initramfs of dmkv's Soft-RoCE test VM.
#
# Usage: build-image.sh [CACHE_DIR]
#   CACHE_DIR defaults to $DMKV_RDMA_VM_CACHE, else /var/cache/dmkv-rdma-vm.
# Outputs in CACHE_DIR: kernel (uncompressed vmlinux ELF, or the bzImage as a fallback),
# initramfs.cpio.zst (the whole guest root filesystem) and stamp (the inputs it was built from).
# Idempotent: if the stamp matches the current inputs it does nothing. Prints CACHE_DIR.
#
# Needs root and apt access to Debian 12 (bookworm): the guest is built from the same Debian
# mirrors the host's apt is configured with, so it needs no other network access.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${1:-${DMKV_RDMA_VM_CACHE:-/var/cache/dmkv-rdma-vm}}

log() { echo "build-image: $*" >&2; }
[ "$(id -u)" = 0 ] || { log "must run as root (mmdebstrap --mode=root, apt-get)"; exit 1; }

# First non-security and security mirror of the host's apt sources (deb822 and one-line style).
apt_uris() {
  local f
  for f in /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && awk '/^URIs:/{for (i = 2; i <= NF; i++) print $i}' "$f"
  done
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$f" ] && awk '$1 == "deb" {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; break}}' "$f"
  done
  return 0
}
MIRROR=${DMKV_RDMA_VM_MIRROR:-$(apt_uris | grep -v -- -security | head -n 1 || true)}
SECMIRROR=${DMKV_RDMA_VM_SECURITY_MIRROR:-$(apt_uris | grep -- -security | head -n 1 || true)}
[ -n "$MIRROR" ] || { log "no Debian mirror in the host's apt sources; set DMKV_RDMA_VM_MIRROR"; exit 1; }

# Guest userland: verbs runtime + rxe provider, iproute2 for `rdma link`, perftest for baselines.
GUEST_PKGS=mount,kmod,iproute2,procps,libibverbs1,ibverbs-providers,ibverbs-utils,perftest,librdmacm1
GUEST_PKGS+=${DMKV_RDMA_VM_EXTRA_PKGS:+,$DMKV_RDMA_VM_EXTRA_PKGS}
# Kernel modules copied into the guest; modprobe --show-depends adds their dependencies.
MODS="virtio_pci virtio_net 9pnet_virtio 9p crc32_generic crc32_pclmul rdma_rxe ib_uverbs rdma_ucm dummy"

need=()
for p in qemu-system-x86 mmdebstrap cpio kmod zstd xz-utils; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  log "installing host packages: ${need[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# linux-image-amd64 is a metapackage; the stamp must name the real, versioned kernel package.
kernel_pkg() { apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}'; }
KPKG=$(kernel_pkg)
[ -n "$KPKG" ] || { apt-get update -qq; KPKG=$(kernel_pkg); }
[ -n "$KPKG" ] || { log "cannot resolve linux-image-amd64"; exit 1; }
KVER=${KPKG#linux-image-}
KDEBVER=$(apt-cache policy "$KPKG" | awk '/Candidate:/{print $2}')
# Bump RECIPE when a change to this script changes the image it builds.
RECIPE=1
STAMP="recipe $RECIPE|$KPKG=$KDEBVER|$GUEST_PKGS|$MODS|$(sha256sum < "$HERE/guest-init.sh" | cut -c1-16)"

mkdir -p "$CACHE"
if [ -f "$CACHE/stamp" ] && [ "$(cat "$CACHE/stamp")" = "$STAMP" ] \
   && [ -s "$CACHE/kernel" ] && [ -s "$CACHE/initramfs.cpio.zst" ]; then
  log "up to date in $CACHE"; echo "$CACHE"; exit 0
fi

t0=$(date +%s)
W="$CACHE/work"
rm -rf "$W"; mkdir -p "$W/deb" "$W/k"
trap 'rm -rf "$W"' EXIT
log "fetching $KPKG $KDEBVER"
(cd "$W/deb" && apt-get download -q "$KPKG" >/dev/null 2>&1) || { log "apt-get download $KPKG failed"; exit 1; }
dpkg -x "$W"/deb/*.deb "$W/k"
depmod -b "$W/k" "$KVER"

log "mmdebstrap bookworm with $GUEST_PKGS"
# The merged-usr hook does the /usr merge with symlinks instead of the usrmerge package (perl, ~45 MB).
mmdebstrap --variant=essential --mode=root --quiet \
  --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include="$GUEST_PKGS" \
  --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/info/*' \
  bookworm "$W/rootfs" \
  "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" ${SECMIRROR:+"deb $SECMIRROR bookworm-security main"}

log "copying kernel modules"
KM="$W/rootfs/usr/lib/modules/$KVER"
mkdir -p "$KM"
cp "$W/k/lib/modules/$KVER"/modules.{order,builtin,builtin.modinfo} "$KM/"
for m in $MODS; do modprobe -d "$W/k" -S "$KVER" --show-depends "$m"; done \
  | awk '$1 == "insmod" {print $2}' | sort -u | while read -r f; do
      rel=${f#"$W/k/lib/modules/$KVER/"}
      mkdir -p "$KM/$(dirname "$rel")"; cp "$f" "$KM/$rel"
    done
depmod -b "$W/rootfs" "$KVER"
install -m 0755 "$HERE/guest-init.sh" "$W/rootfs/init"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n10.0.2.15\tdmkv-vm\n' > "$W/rootfs/etc/hosts"
echo dmkv-vm > "$W/rootfs/etc/hostname"
rm -rf "$W/rootfs/var/cache/apt"/* "$W/rootfs/var/lib/apt/lists"/* 2>/dev/null || true

log "packing initramfs"
(cd "$W/rootfs" && find . -print0 | cpio --null -o -H newc --quiet) | zstd -q -T0 -10 > "$CACHE/initramfs.cpio.zst.new"
mv "$CACHE/initramfs.cpio.zst.new" "$CACHE/initramfs.cpio.zst"

# QEMU can boot an uncompressed vmlinux ELF through its PVH entry point, which skips the
# real-mode setup code of a bzImage: several seconds less per boot under software emulation.
VZ="$W/k/boot/vmlinuz-$KVER"
off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$VZ" | head -n 1 | cut -d: -f1 || true)
if [ -n "$off" ] && { tail -c +$((off + 1)) "$VZ" | xz -dc > "$W/vmlinux" 2>/dev/null || true; } \
   && [ "$(head -c 4 "$W/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ]; then
  mv "$W/vmlinux" "$CACHE/kernel"
else
  log "no xz payload in the bzImage; booting the bzImage"
  cp "$VZ" "$CACHE/kernel"
fi
echo "$STAMP" > "$CACHE/stamp"
rm -rf "$W"
log "built in $(( $(date +%s) - t0 )) s: $(du -sh "$CACHE" | cut -f1) (kernel $KVER)"
echo "$CACHE"
