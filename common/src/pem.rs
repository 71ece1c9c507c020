//! PEM files of TLS material, read the same way by client and server:
//! certificate chains and CA bundles that must hold at least one
//! certificate, with errors that name the file.

use std::path::Path;

use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;

/// The certificates in the PEM file at `path`; an error names the file and
/// says what is wrong, including a file with no certificate in it.
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("TLS certificates {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("TLS certificates {}: no certificate in it", path.display()));
    }
    Ok(certs)
}
