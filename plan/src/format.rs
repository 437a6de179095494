//! The plan file format: `FLASHPLN` magic, a little-endian u32 header length, the bincode-encoded
//! [`PlanHeader`], then the bincode-encoded [`PlanBody`] (bincode 2.0.1, standard config, through serde).
//! Files are written atomically (temporary file in the same folder, fsync, rename, fsync of the folder) and are
//! deterministic: the same inputs give byte-identical files.

use std::io::Write;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::plan::{PlanBody, PlanHeader, PlanSet};
use crate::validate::{validate_body, ValidationError};

/// Version of the on-disk format; bumped on every incompatible change (2: state pieces start at multiples of 4
/// elements, which the CUDA backend's float4 reads of the GDN state need; 3: `Op::Sample`'s probabilities are
/// optional, and only the MTP step's sampling has them).
pub const FORMAT_VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"FLASHPLN";

/// Errors reading, writing or matching a plan file.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// The file could not be read or written.
    #[error("{path}: {cause}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause (in the message, not a separate source, so that it prints once).
        cause: std::io::Error,
    },
    /// Not a plan file, or truncated.
    #[error("{path}: not a flashplan plan file ({why})")]
    NotAPlan {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        why: String,
    },
    /// Written by another format version.
    #[error("{path}: plan format version {found}, this build reads version {expected}; recompile the plans")]
    Version {
        /// The file.
        path: PathBuf,
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        expected: u32,
    },
    /// The body does not match its checksum (corrupt file).
    #[error("{path}: plan body checksum mismatch (header says {expected}, body hashes to {found}): the file is corrupt")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// Checksum in the header.
        expected: String,
        /// Checksum of the body found.
        found: String,
    },
    /// The plan was built for something else than what it is used with.
    #[error("plan mismatch: {what} is {found} in the plan but {expected} here; recompile the plans for this {what}")]
    Mismatch {
        /// Which header field differs (`config`, `arch`, `kernel sources`).
        what: &'static str,
        /// Value in the plan.
        found: String,
        /// Value expected.
        expected: String,
    },
    /// Encoding or decoding failed.
    #[error("plan encoding: {0}")]
    Codec(String),
    /// The plan breaks a structural rule.
    #[error(transparent)]
    Invalid(#[from] ValidationError),
}

/// SHA-256 as lowercase hex.
pub fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

/// The plan header's `kernel_source_hash`: SHA-256 (hex) over every kernel source file (name, NUL, text, NUL), in
/// the given (name-sorted) order. The compiler and the runtime hash their own bundled copies with it.
pub fn kernel_source_hash(sources: &[(&str, &str)]) -> String {
    let mut all = Vec::new();
    for (name, text) in sources {
        all.extend_from_slice(name.as_bytes());
        all.push(0);
        all.extend_from_slice(text.as_bytes());
        all.push(0);
    }
    sha256_hex(&all)
}

/// The hash keying one compiled kernel module (`KernelModule::source_hash`): its file name and text, then every
/// header (non-`.cu` file) of `sources`, so a header change rebuilds every module.
pub fn kernel_module_hash(name: &str, src: &str, sources: &[(&str, &str)]) -> String {
    let mut all = Vec::new();
    all.extend_from_slice(name.as_bytes());
    all.push(0);
    all.extend_from_slice(src.as_bytes());
    for (n, t) in sources {
        if !n.ends_with(".cu") {
            all.push(0);
            all.extend_from_slice(n.as_bytes());
            all.push(0);
            all.extend_from_slice(t.as_bytes());
        }
    }
    sha256_hex(&all)
}

/// The hash identifying a config: SHA-256 of its canonical JSON (serde field order, deterministic).
pub fn config_hash(cfg: &crate::ModelConfig) -> String {
    sha256_hex(serde_json::to_string(cfg).unwrap_or_default().as_bytes())
}

fn bincode_cfg() -> bincode::config::Configuration {
    bincode::config::standard()
}

/// The config fields [`config_difference`] names first when they differ: those that size the model
/// ([`crate::config::SIZE_FIELDS`], in the order a reader compares two models), then these two, then every other
/// field by name.
const SHAPE_FIELDS_AFTER_SIZES: &[&str] = &["layer_types", "mtp"];

/// The most characters of one value [`config_difference`] prints (a longer one ends in `...`).
const VALUE_CHARS: usize = 60;

/// The config fields that differ between `plan` and `here` (at most four: the sizes and [`SHAPE_FIELDS_AFTER_SIZES`]
/// first, then by name),
/// as (the plan's values, these values); `None` when no field differs by value.
fn config_difference(
    plan: &crate::ModelConfig,
    here: &crate::ModelConfig,
) -> Option<(String, String)> {
    let (a, b) = (
        serde_json::to_value(plan).ok()?,
        serde_json::to_value(here).ok()?,
    );
    let (a, b) = (a.as_object()?, b.as_object()?);
    let mut keys: Vec<&String> = a.keys().chain(b.keys()).collect();
    let rank = |k: &str| {
        crate::config::SIZE_FIELDS
            .iter()
            .chain(SHAPE_FIELDS_AFTER_SIZES)
            .position(|f| *f == k)
            .unwrap_or(usize::MAX)
    };
    keys.sort_by(|x, y| rank(x).cmp(&rank(y)).then(x.cmp(y)));
    keys.dedup();
    let diff: Vec<&String> = keys
        .into_iter()
        .filter(|k| a.get(*k) != b.get(*k))
        .collect();
    if diff.is_empty() {
        return None;
    }
    let more = if diff.len() > 4 {
        format!(" (and {} more)", diff.len() - 4)
    } else {
        String::new()
    };
    let side = |m: &serde_json::Map<String, serde_json::Value>| {
        let fields: Vec<String> = diff
            .iter()
            .take(4)
            .map(|k| {
                let v = m.get(*k).unwrap_or(&serde_json::Value::Null).to_string();
                let short = if v.chars().count() > VALUE_CHARS {
                    v.chars().take(VALUE_CHARS).chain("...".chars()).collect()
                } else {
                    v
                };
                format!("{k} = {short}")
            })
            .collect();
        fields.join(", ") + &more
    };
    Some((side(a), side(b)))
}

/// Encodes a body (deterministic bytes).
pub fn encode_body(body: &PlanBody) -> Result<Vec<u8>, FormatError> {
    bincode::serde::encode_to_vec(body, bincode_cfg())
        .map_err(|e| FormatError::Codec(e.to_string()))
}

impl PlanSet {
    /// Builds the header for a body (validating it first).
    pub fn seal(
        body: PlanBody,
        kernel_source_hash: &str,
        compiler_version: &str,
    ) -> Result<PlanSet, FormatError> {
        validate_body(&body)?;
        let bytes = encode_body(&body)?;
        let header = PlanHeader {
            format_version: FORMAT_VERSION,
            config_hash: config_hash(&body.config),
            kernel_source_hash: kernel_source_hash.to_string(),
            arch: body.options.arch.clone(),
            compiler_version: compiler_version.to_string(),
            body_checksum: sha256_hex(&bytes),
        };
        Ok(PlanSet { header, body })
    }

    /// Encodes the whole file.
    pub fn to_bytes(&self) -> Result<Vec<u8>, FormatError> {
        let header = bincode::serde::encode_to_vec(&self.header, bincode_cfg())
            .map_err(|e| FormatError::Codec(e.to_string()))?;
        let body = encode_body(&self.body)?;
        let mut out = Vec::with_capacity(12 + header.len() + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
        out.extend_from_slice(&header);
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Writes the file atomically: a temporary file beside `path`, fsync, rename over `path`, then (on Unix) an
    /// fsync of the folder.
    pub fn write_atomic(&self, path: &Path) -> Result<(), FormatError> {
        let bytes = self.to_bytes()?;
        write_atomic(path, &bytes)
    }

    /// Decodes a file's bytes, checking magic, version, checksum and the structural rules.
    pub fn from_bytes(bytes: &[u8], path: &Path) -> Result<PlanSet, FormatError> {
        let not_plan = |why: &str| FormatError::NotAPlan {
            path: path.to_path_buf(),
            why: why.to_string(),
        };
        if bytes.len() < 12 || &bytes[..8] != MAGIC {
            return Err(not_plan("missing FLASHPLN magic"));
        }
        let hlen = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize;
        if bytes.len() < 12 + hlen {
            return Err(not_plan("truncated header"));
        }
        let (header, _): (PlanHeader, usize) =
            bincode::serde::decode_from_slice(&bytes[12..12 + hlen], bincode_cfg())
                .map_err(|e| not_plan(&format!("header does not decode: {e}")))?;
        if header.format_version != FORMAT_VERSION {
            return Err(FormatError::Version {
                path: path.to_path_buf(),
                found: header.format_version,
                expected: FORMAT_VERSION,
            });
        }
        let body_bytes = &bytes[12 + hlen..];
        let found = sha256_hex(body_bytes);
        if found != header.body_checksum {
            return Err(FormatError::Checksum {
                path: path.to_path_buf(),
                expected: header.body_checksum,
                found,
            });
        }
        let (body, used): (PlanBody, usize) =
            bincode::serde::decode_from_slice(body_bytes, bincode_cfg())
                .map_err(|e| not_plan(&format!("body does not decode: {e}")))?;
        if used != body_bytes.len() {
            return Err(not_plan("trailing bytes after the body"));
        }
        if config_hash(&body.config) != header.config_hash {
            return Err(not_plan(
                "config hash in the header does not match the body's config",
            ));
        }
        validate_body(&body)?;
        Ok(PlanSet { header, body })
    }

    /// Reads and checks a plan file.
    pub fn read(path: &Path) -> Result<PlanSet, FormatError> {
        let bytes = std::fs::read(path).map_err(|cause| FormatError::Io {
            path: path.to_path_buf(),
            cause,
        })?;
        Self::from_bytes(&bytes, path)
    }

    /// Refuses a plan built for another config, arch or kernel sources, naming what differs.
    pub fn check_matches(
        &self,
        cfg: &crate::ModelConfig,
        arch: &str,
        kernel_source_hash: Option<&str>,
    ) -> Result<(), FormatError> {
        let want = config_hash(cfg);
        if self.header.config_hash != want {
            let (found, expected) = config_difference(&self.body.config, cfg)
                .unwrap_or_else(|| (self.header.config_hash.clone(), want));
            return Err(FormatError::Mismatch {
                what: "config",
                found,
                expected,
            });
        }
        if self.header.arch != arch {
            return Err(FormatError::Mismatch {
                what: "arch",
                found: self.header.arch.clone(),
                expected: arch.into(),
            });
        }
        if let Some(k) = kernel_source_hash {
            if self.header.kernel_source_hash != k {
                return Err(FormatError::Mismatch {
                    what: "kernel sources",
                    found: self.header.kernel_source_hash.clone(),
                    expected: k.into(),
                });
            }
        }
        Ok(())
    }
}

/// Writes `bytes` to `path` atomically (temporary file in the same folder, fsync, rename, then an fsync of the
/// folder on Unix, so that a crash after the call returns cannot undo the rename).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), FormatError> {
    let io = |cause| FormatError::Io {
        path: path.to_path_buf(),
        cause,
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).map_err(|cause| FormatError::Io {
        path: dir.to_path_buf(),
        cause,
    })?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "plan".into());
    // Unique per process and per call, so that two threads writing the same file never share a temporary one.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(".{name}.tmp{}-{n}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(io)?;
    sync_dir(dir).map_err(|cause| FormatError::Io {
        path: dir.to_path_buf(),
        cause,
    })
}

#[cfg(test)]
thread_local! {
    /// The folders [`sync_dir`] flushed on this thread (a flush has no other trace short of a crash).
    static SYNCED_DIRS: std::cell::RefCell<Vec<PathBuf>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Flushes a folder's entries (a rename into it) to disk.
#[cfg(unix)]
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    #[cfg(test)]
    SYNCED_DIRS.with(|d| d.borrow_mut().push(dir.to_path_buf()));
    std::fs::File::open(dir)?.sync_all()
}

/// Elsewhere a folder cannot be opened as a file to flush it (Windows: NTFS journals the rename itself).
#[cfg(not(unix))]
fn sync_dir(_dir: &Path) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn write_atomic_flushes_the_folder_after_the_rename() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().join("plans");
        let path = dir.join("plans.fplan");
        SYNCED_DIRS.with(|d| d.borrow_mut().clear());
        write_atomic(&path, b"one").expect("first write");
        write_atomic(&path, b"two").expect("second write");
        assert_eq!(std::fs::read(&path).expect("read"), b"two");
        assert_eq!(
            SYNCED_DIRS.with(|d| d.borrow().clone()),
            [dir.clone(), dir.clone()]
        );
        // No temporary file is left beside it.
        let names: Vec<_> = std::fs::read_dir(&dir)
            .expect("read_dir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["plans.fplan"]);
    }
}
