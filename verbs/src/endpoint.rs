//! The connection data two peers exchange out of band, and its wire encoding.

use crate::error::VerbsError;

/// PSNs are 24-bit.
pub(crate) const PSN_MASK: u32 = 0x00ff_ffff;

/// Converts an `ibv_mtu` enum value (1..=5) to bytes.
pub fn mtu_bytes(mtu: u32) -> Option<u32> {
    (1..=5).contains(&mtu).then(|| 128 << mtu)
}

/// What a peer needs to connect an RC queue pair to ours. Exchanged out of band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// Queue pair number.
    pub qpn: u32,
    /// Initial packet sequence number of our send queue (24 bits).
    pub psn: u32,
    /// Our source GID (network byte order).
    pub gid: [u8; 16],
    /// Our port's LID (InfiniBand only; 0 on RoCE).
    pub lid: u16,
    /// Our port's active MTU as an `ibv_mtu` enum value (1 = 256 B … 5 = 4096 B), not bytes.
    pub mtu: u32,
}

impl Endpoint {
    /// Size of the wire encoding.
    pub const WIRE_LEN: usize = 30;

    /// Fixed little-endian layout: qpn u32 | psn u32 | gid [16] | lid u16 | mtu u32.
    pub fn to_bytes(&self) -> [u8; Self::WIRE_LEN] {
        let mut b = [0u8; Self::WIRE_LEN];
        b[0..4].copy_from_slice(&self.qpn.to_le_bytes());
        b[4..8].copy_from_slice(&self.psn.to_le_bytes());
        b[8..24].copy_from_slice(&self.gid);
        b[24..26].copy_from_slice(&self.lid.to_le_bytes());
        b[26..30].copy_from_slice(&self.mtu.to_le_bytes());
        b
    }

    /// Decodes [`Endpoint::to_bytes`]; rejects a wrong length, a PSN wider than 24 bits and an
    /// MTU outside the `ibv_mtu` range.
    pub fn from_bytes(b: &[u8]) -> Result<Endpoint, VerbsError> {
        let b: &[u8; Self::WIRE_LEN] = b
            .try_into()
            .map_err(|_| VerbsError::BadEndpoint(format!("{} bytes, expected {}", b.len(), Self::WIRE_LEN)))?;
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[8..24]);
        let ep =
            Endpoint { qpn: u32_at(0), psn: u32_at(4), gid, lid: u16::from_le_bytes([b[24], b[25]]), mtu: u32_at(26) };
        if ep.psn & !PSN_MASK != 0 {
            return Err(VerbsError::BadEndpoint(format!("psn {:#x} exceeds 24 bits", ep.psn)));
        }
        if mtu_bytes(ep.mtu).is_none() {
            return Err(VerbsError::BadEndpoint(format!("mtu {} is not an ibv_mtu value", ep.mtu)));
        }
        Ok(ep)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Endpoint {
        let mut gid = [0u8; 16];
        gid[10] = 0xff;
        gid[11] = 0xff;
        gid[12..].copy_from_slice(&[10, 0, 2, 15]);
        Endpoint { qpn: 0x11, psn: 0xab_cdef, gid, lid: 7, mtu: 3 }
    }

    #[test]
    fn endpoint_roundtrip_and_layout() {
        let ep = sample();
        let b = ep.to_bytes();
        assert_eq!(&b[0..4], &[0x11, 0, 0, 0]);
        assert_eq!(&b[4..8], &[0xef, 0xcd, 0xab, 0]);
        assert_eq!(&b[24..26], &[7, 0]);
        assert_eq!(&b[26..30], &[3, 0, 0, 0]);
        assert_eq!(Endpoint::from_bytes(&b), Ok(ep));
    }

    #[test]
    fn endpoint_rejects_bad_input() {
        let b = sample().to_bytes();
        assert!(matches!(Endpoint::from_bytes(&b[..29]), Err(VerbsError::BadEndpoint(_))));
        let mut long = b.to_vec();
        long.push(0);
        assert!(matches!(Endpoint::from_bytes(&long), Err(VerbsError::BadEndpoint(_))));
        let mut bad_mtu = b;
        bad_mtu[26] = 9;
        assert!(matches!(Endpoint::from_bytes(&bad_mtu), Err(VerbsError::BadEndpoint(_))));
        let mut bad_psn = b;
        bad_psn[7] = 1;
        assert!(matches!(Endpoint::from_bytes(&bad_psn), Err(VerbsError::BadEndpoint(_))));
    }

    #[test]
    fn mtu_helper() {
        assert_eq!(mtu_bytes(1), Some(256));
        assert_eq!(mtu_bytes(3), Some(1024));
        assert_eq!(mtu_bytes(5), Some(4096));
        assert_eq!(mtu_bytes(0), None);
    }
}
