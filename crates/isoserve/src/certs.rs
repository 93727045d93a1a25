//! `isoserve transfer-certs`: a CA and one certificate per node for the
//! transfer channel's mutual TLS (K14), so that a deployment can be secured
//! in one command. Operators with a PKI of their own use theirs: any CA
//! works, as long as every node certificate carries the transfer server
//! name (`isoserve-transfer` by default) as a DNS name.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

/// Names a node certificate may take: what goes into a file name.
const NODE_NAME_BYTES_MAX: usize = 64;
const NODES_MAX: usize = 256;

#[derive(clap::Args, Debug)]
pub struct CertsArgs {
    /// Directory to write `ca.pem`, `ca.key` and `NODE.pem`/`NODE.key` for
    /// every node (created if missing; existing files are never
    /// overwritten).
    #[arg(long)]
    pub out: PathBuf,
    /// Node names, comma-separated (e.g. `gateway,prefill-0,decode-0`);
    /// each certificate also names --server-name.
    #[arg(long, value_delimiter = ',', required = true)]
    pub nodes: Vec<String>,
    /// The DNS name every node certificate carries (the nodes'
    /// --transfer-tls-server-name).
    #[arg(long, default_value = transport::tls::DEFAULT_SERVER_NAME)]
    pub server_name: String,
    /// Validity in days.
    #[arg(long, default_value_t = 365)]
    pub days: u32,
}

fn check_name(n: &str) -> Result<()> {
    let ok = !n.is_empty()
        && n.len() <= NODE_NAME_BYTES_MAX
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
        && !n.starts_with('.');
    if !ok {
        bail!("node name `{n}`: use 1–{NODE_NAME_BYTES_MAX} of a-z A-Z 0-9 - . _");
    }
    if n == "ca" {
        bail!("node name `ca` is taken by the CA's own files");
    }
    Ok(())
}

fn write_new(path: &Path, data: &str, private: bool) -> Result<()> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(if private { 0o600 } else { 0o644 });
    }
    let mut f = o.open(path).with_context(|| {
        if path.exists() {
            format!("{} exists; not overwriting it", path.display())
        } else {
            format!("cannot create {}", path.display())
        }
    })?;
    f.write_all(data.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))
}

fn validity(p: &mut CertificateParams, days: u32) {
    let now = std::time::SystemTime::now();
    p.not_before = (now - std::time::Duration::from_secs(3600)).into();
    p.not_after = (now + std::time::Duration::from_secs(u64::from(days) * 86_400)).into();
}

pub fn run(args: CertsArgs) -> Result<()> {
    if args.nodes.len() > NODES_MAX {
        bail!("at most {NODES_MAX} nodes at once");
    }
    if !(1..=3650).contains(&args.days) {
        bail!("--days must be in 1..=3650");
    }
    for n in &args.nodes {
        check_name(n)?;
    }
    let mut seen = std::collections::BTreeSet::new();
    for n in &args.nodes {
        if !seen.insert(n) {
            bail!("node `{n}` named twice");
        }
    }
    if tokio_rustls_server_name_ok(&args.server_name).is_err() {
        bail!("--server-name `{}` is not a DNS name", args.server_name);
    }
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    // Fail before writing anything if a file is in the way.
    let mut files = vec![args.out.join("ca.pem"), args.out.join("ca.key")];
    for n in &args.nodes {
        files.push(args.out.join(format!("{n}.pem")));
        files.push(args.out.join(format!("{n}.key")));
    }
    if let Some(f) = files.iter().find(|f| f.exists()) {
        bail!("{} exists; not overwriting it", f.display());
    }
    let ca_key = KeyPair::generate().context("cannot generate the CA key")?;
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.distinguished_name
        .push(DnType::CommonName, "isoserve transfer CA");
    p.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    validity(&mut p, args.days);
    let ca = p.self_signed(&ca_key).context("cannot sign the CA")?;
    write_new(&args.out.join("ca.pem"), &ca.pem(), false)?;
    write_new(&args.out.join("ca.key"), &ca_key.serialize_pem(), true)?;
    for n in &args.nodes {
        let key = KeyPair::generate().context("cannot generate a node key")?;
        let mut sans = vec![args.server_name.clone()];
        if n != &args.server_name {
            sans.push(n.clone());
        }
        let mut p = CertificateParams::new(sans)?;
        p.distinguished_name.push(DnType::CommonName, n.as_str());
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        validity(&mut p, args.days);
        let cert = p
            .signed_by(&key, &ca, &ca_key)
            .with_context(|| format!("cannot sign {n}'s certificate"))?;
        write_new(&args.out.join(format!("{n}.pem")), &cert.pem(), false)?;
        write_new(
            &args.out.join(format!("{n}.key")),
            &key.serialize_pem(),
            true,
        )?;
    }
    println!(
        "wrote {} (CA) and a certificate and key for {} node(s) naming `{}`; \
         keep ca.key offline",
        args.out.join("ca.pem").display(),
        args.nodes.len(),
        args.server_name
    );
    Ok(())
}

fn tokio_rustls_server_name_ok(name: &str) -> Result<(), ()> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(())
    }
}
