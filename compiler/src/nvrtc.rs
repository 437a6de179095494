//! NVRTC pipeline: compiles the bundled kernel sources (`kernels/*.cu`, with `params.h` and `common.cuh` given to
//! NVRTC as in-memory headers) into cubin for an NVIDIA arch such as `sm_90a` (`nvrtcGetCUBIN`: PTX from a newer
//! NVRTC would not load on the CUDA 13.0 driver). Works with no GPU; needs `libnvrtc.so.13` on the loader path
//! (`scripts/setup_nvrtc.sh` installs the pinned 13.0.x wheel and prints the environment to export).
//!
//! Any NVRTC diagnostic, warning or error, fails the compile: the log must be empty.
//!
//! `FLASHPLAN_KERNEL_CACHE=<dir>`: cubins are read from / written to `<dir>/<stem>-<hash>-<arch>.cubin`, keyed by
//! the module's source hash (and the hash of every header), so a machine without NVRTC can compile GPU plans from a
//! cache filled elsewhere.

use std::ffi::{c_char, c_int, CString};

use flashplan_plan::KernelModule;

mod bundled {
    include!(concat!(env!("OUT_DIR"), "/kernel_sources.rs"));
}

/// The kernel sources bundled into this binary: (file name, text), sorted by name.
pub fn sources() -> &'static [(&'static str, &'static str)] {
    bundled::KERNEL_SOURCES
}

/// SHA-256 (hex) over every bundled kernel source (name and text, in name order): the plan header's
/// `kernel_source_hash` for GPU plans. The runtime computes the same from its own bundle.
pub fn source_hash() -> String {
    flashplan_plan::format::kernel_source_hash(sources())
}

/// Errors compiling kernels.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// libnvrtc could not be loaded.
    #[error("NVRTC (libnvrtc.so.13) is not on the loader path: run scripts/setup_nvrtc.sh and export what it prints (LD_LIBRARY_PATH), or set FLASHPLAN_KERNEL_CACHE to a folder of prebuilt cubins")]
    Missing,
    /// NVRTC is missing and the kernel cache has no usable cubin for a module of these sources.
    #[error("NVRTC (libnvrtc.so.13) is not on the loader path and FLASHPLAN_KERNEL_CACHE has no usable {path} ({why}); cubins are keyed by a hash of the kernel sources: fill the cache on a machine with NVRTC (scripts/setup_nvrtc.sh), or run there")]
    MissingCubin {
        /// The cubin looked for.
        path: std::path::PathBuf,
        /// Missing, or why the file there is unusable.
        why: String,
    },
    /// `FLASHPLAN_KERNEL_CACHE` is set but empty.
    #[error("FLASHPLAN_KERNEL_CACHE is set but empty: expected a folder (unset it to compile without a cache)")]
    EmptyCache,
    /// The arch is not an NVIDIA arch.
    #[error("arch {0}: expected an NVIDIA arch such as sm_90a")]
    Arch(String),
    /// A module failed to compile or printed diagnostics.
    #[error("kernels/{module}: NVRTC {status}:\n{log}")]
    Compile {
        /// The `.cu` file.
        module: String,
        /// NVRTC status.
        status: String,
        /// The compiler log.
        log: String,
    },
}

/// Entry points a module source exports: every `extern "C" __global__ void NAME(`, also with launch bounds
/// (`extern "C" __global__ void __launch_bounds__(...) NAME(`).
pub fn entry_points(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in src.lines() {
        if let Some(rest) = line
            .trim_start()
            .strip_prefix("extern \"C\" __global__ void ")
        {
            let rest = match rest.strip_prefix("__launch_bounds__(") {
                Some(r) => r
                    .split_once(')')
                    .map_or("", |(_, after)| after.trim_start()),
                None => rest,
            };
            if let Some(name) = rest.split('(').next() {
                out.push(name.trim().to_string());
            }
        }
    }
    out
}

/// The hash keying one module's cubin: its source and every header.
fn module_hash(name: &str, src: &str) -> String {
    flashplan_plan::format::kernel_module_hash(name, src, sources())
}

/// The kernel cache folder (`FLASHPLAN_KERNEL_CACHE`), if set.
///
/// # Errors
/// [`NvrtcError::EmptyCache`] when set but empty (it would mean the current directory).
fn cache_dir() -> Result<Option<std::path::PathBuf>, NvrtcError> {
    flashplan_plan::env::folder("FLASHPLAN_KERNEL_CACHE").map_err(|_| NvrtcError::EmptyCache)
}

/// A module's cubin in the cache folder `dir`: named by the module, its hash and the arch.
fn cache_path(dir: &std::path::Path, stem: &str, hash: &str, arch: &str) -> std::path::PathBuf {
    dir.join(format!("{stem}-{}-{arch}.cubin", &hash[..16]))
}

/// Module `name`'s cubin from the cache folder `cache` when a whole one is there, else compiled (and then written to
/// the cache, whole or not at all: a temporary file renamed, so a crash or a second process never leaves a truncated
/// cubin for later runs; the cache is an optimisation, so a failure to write it is not an error).
///
/// # Errors
/// [`NvrtcError::MissingCubin`] when NVRTC is missing and the cache has no whole cubin; else as [`compile_source`].
fn cached_or_compiled(
    name: &str,
    src: &str,
    hash: &str,
    arch: &str,
    cache: Option<&std::path::Path>,
) -> Result<Vec<u8>, NvrtcError> {
    let stem = name.trim_end_matches(".cu");
    let path = cache.map(|d| cache_path(d, stem, hash, arch));
    let cached = path.as_ref().map(|p| match std::fs::read(p) {
        Ok(c) if cubin_is_whole(&c) => Ok(c),
        Ok(_) => Err("the file there is truncated or not a cubin".to_string()),
        Err(e) => Err(e.to_string()),
    });
    if let Some(Ok(c)) = cached {
        return Ok(c);
    }
    let c = compile_one(name, src, arch).map_err(|e| match (e, &path, cached) {
        (NvrtcError::Missing, Some(p), Some(Err(why))) => NvrtcError::MissingCubin {
            path: p.clone(),
            why,
        },
        (e, ..) => e,
    })?;
    if let Some(p) = &path {
        let _ = flashplan_plan::format::write_atomic(p, &c);
    }
    Ok(c)
}

/// Compiles every bundled `.cu` module for `arch` (e.g. `sm_90a`) into cubin.
///
/// # Errors
/// [`NvrtcError`] when NVRTC is missing, or a module fails or prints any diagnostic.
pub fn compile_kernels(arch: &str) -> Result<Vec<KernelModule>, NvrtcError> {
    if !arch.starts_with("sm_") {
        return Err(NvrtcError::Arch(arch.to_string()));
    }
    let cache = cache_dir()?;
    let mut out = Vec::new();
    for (name, src) in sources().iter().filter(|(n, _)| n.ends_with(".cu")) {
        let stem = name.trim_end_matches(".cu").to_string();
        let hash = module_hash(name, src);
        let cubin = cached_or_compiled(name, src, &hash, arch, cache.as_deref())?;
        out.push(KernelModule {
            name: stem,
            source_hash: hash,
            cubin,
            entry_points: entry_points(src),
        });
    }
    Ok(out)
}

/// Whether `bytes` look like a whole ELF file (a cubin): the ELF magic, 64-bit, and the program header table, the
/// section header table and every section's contents inside the file. A truncated cache file fails this and is
/// compiled again.
fn cubin_is_whole(bytes: &[u8]) -> bool {
    let len = bytes.len() as u64;
    let at = |o: u64, n: usize| bytes.get(o as usize..o as usize + n);
    let u16_at = |o: u64| at(o, 2).map(|b| u16::from_le_bytes([b[0], b[1]]) as u64);
    let u32_at = |o: u64| {
        at(o, 4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    };
    let u64_at = |o: u64| {
        at(o, 8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    };
    let inside = |off: u64, size: u64| off.checked_add(size).is_some_and(|end| end <= len);
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 {
        return false;
    }
    let table = |off, ent, num| match (u64_at(off), u16_at(ent), u16_at(num)) {
        (Some(o), Some(e), Some(n)) => inside(o, e * n).then_some((o, e, n)),
        _ => None,
    };
    // Program headers at e_phoff (0x20), e_phentsize (0x36), e_phnum (0x38); sections at 0x28, 0x3A, 0x3C.
    let (Some(_), Some((shoff, shent, shnum))) = (table(0x20, 0x36, 0x38), table(0x28, 0x3A, 0x3C))
    else {
        return false;
    };
    // Each section's contents (sh_offset at +0x18, sh_size at +0x20), but SHT_NOBITS (8), which has none.
    (0..shnum).all(|i| {
        let h = shoff + i * shent;
        match (u32_at(h + 4), u64_at(h + 0x18), u64_at(h + 0x20)) {
            (Some(8), ..) => true,
            (Some(_), Some(off), Some(size)) => inside(off, size),
            _ => false,
        }
    })
}

/// Compiles one source (with the bundled headers available) into cubin; any diagnostic fails.
///
/// # Errors
/// [`NvrtcError`] when NVRTC is missing or the source fails or prints diagnostics.
pub fn compile_source(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, NvrtcError> {
    compile_one(name, src, arch)
}

fn compile_one(name: &str, src: &str, arch: &str) -> Result<Vec<u8>, NvrtcError> {
    use cudarc::nvrtc::sys;
    // SAFETY: checking for the library only loads it.
    if !unsafe { sys::is_culib_present() } {
        return Err(NvrtcError::Missing);
    }
    let fail = |status: String, log: String| NvrtcError::Compile {
        module: name.to_string(),
        status,
        log,
    };
    let headers: Vec<(&str, &str)> = sources()
        .iter()
        .filter(|(n, _)| !n.ends_with(".cu"))
        .copied()
        .collect();
    let c = |s: &str| CString::new(s).expect("no NUL in kernel sources");
    let src_c = c(src);
    let name_c = c(name);
    let hdr_src: Vec<CString> = headers.iter().map(|(_, t)| c(t)).collect();
    let hdr_name: Vec<CString> = headers.iter().map(|(n, _)| c(n)).collect();
    let hdr_src_p: Vec<*const c_char> = hdr_src.iter().map(|s| s.as_ptr()).collect();
    let hdr_name_p: Vec<*const c_char> = hdr_name.iter().map(|s| s.as_ptr()).collect();
    let opts: Vec<CString> = [
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--device-as-default-execution-space".to_string(),
        "-lineinfo".to_string(),
    ]
    .iter()
    .map(|s| c(s))
    .collect();
    let opts_p: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
    // SAFETY: every pointer handed to NVRTC outlives the program, which is destroyed before returning.
    unsafe {
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        let r = sys::nvrtcCreateProgram(
            &mut prog,
            src_c.as_ptr(),
            name_c.as_ptr(),
            headers.len() as c_int,
            hdr_src_p.as_ptr(),
            hdr_name_p.as_ptr(),
        );
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail(format!("{r:?}"), String::new()));
        }
        let r = sys::nvrtcCompileProgram(prog, opts_p.len() as c_int, opts_p.as_ptr());
        let log = cudarc::nvrtc::result::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
                String::from_utf8_lossy(&bytes).trim().to_string()
            })
            .unwrap_or_default();
        if r != sys::nvrtcResult::NVRTC_SUCCESS || !log.is_empty() {
            let _ = sys::nvrtcDestroyProgram(&mut prog);
            let status = if r == sys::nvrtcResult::NVRTC_SUCCESS {
                "diagnostics (warnings fail the build)".to_string()
            } else {
                format!("{r:?}")
            };
            return Err(fail(status, log));
        }
        let mut size = 0usize;
        let r = sys::nvrtcGetCUBINSize(prog, &mut size);
        if r != sys::nvrtcResult::NVRTC_SUCCESS || size == 0 {
            let _ = sys::nvrtcDestroyProgram(&mut prog);
            return Err(fail(format!("nvrtcGetCUBINSize {r:?}"), String::new()));
        }
        let mut cubin = vec![0u8; size];
        let r = sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char);
        let _ = sys::nvrtcDestroyProgram(&mut prog);
        if r != sys::nvrtcResult::NVRTC_SUCCESS {
            return Err(fail(format!("nvrtcGetCUBIN {r:?}"), String::new()));
        }
        Ok(cubin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_truncated_cached_cubin_is_never_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (name, src) = ("probe.cu", "extern \"C\" __global__ void probe() {}\n");
        let hash = module_hash(name, src);
        let path = cache_path(dir.path(), "probe", &hash, "sm_90a");
        std::fs::write(&path, b"\x7fELF\x02 cut short").expect("write");
        match cached_or_compiled(name, src, &hash, "sm_90a", Some(dir.path())) {
            // With NVRTC: compiled again, and the cache now holds the whole cubin.
            Ok(c) => {
                assert!(cubin_is_whole(&c));
                assert_eq!(std::fs::read(&path).expect("cache"), c);
            }
            // Without: refused, naming the file and why.
            Err(NvrtcError::MissingCubin { path: p, why }) => {
                assert_eq!(p, path);
                assert!(why.contains("truncated"), "{why}");
            }
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn a_whole_elf_file_has_its_section_headers_inside() {
        // A 64-bit ELF header, no program headers, a section header table of 2 entries of 64 bytes at byte 64, the
        // second section's 16 bytes of contents at the end of the file (at 192).
        let mut elf = vec![0u8; 64 + 128 + 16];
        elf[..5].copy_from_slice(b"\x7fELF\x02");
        elf[0x28..0x30].copy_from_slice(&64u64.to_le_bytes());
        elf[0x3A..0x3C].copy_from_slice(&64u16.to_le_bytes());
        elf[0x3C..0x3E].copy_from_slice(&2u16.to_le_bytes());
        let second = 64 + 64;
        elf[second + 4..second + 8].copy_from_slice(&1u32.to_le_bytes());
        elf[second + 0x18..second + 0x20].copy_from_slice(&192u64.to_le_bytes());
        elf[second + 0x20..second + 0x28].copy_from_slice(&16u64.to_le_bytes());
        assert!(cubin_is_whole(&elf));
        // Cut inside the second section's contents (the header tables are whole): not whole.
        assert!(!cubin_is_whole(&elf[..elf.len() - 1]));
        // A NOBITS section has no contents in the file.
        let mut nobits = elf[..192].to_vec();
        nobits[second + 4..second + 8].copy_from_slice(&8u32.to_le_bytes());
        assert!(cubin_is_whole(&nobits));
        assert!(!cubin_is_whole(
            b"not an elf file at all, but long enough to pass the size check for sure...."
        ));
    }

    #[test]
    fn entry_points_read_names_with_and_without_launch_bounds() {
        let src = "extern \"C\" __global__ void plain(const P p) {}\n\
                   extern \"C\" __global__ void __launch_bounds__(256, 2) bounded(const P p) {}\n\
                   DEV void helper(const P p) {}\n";
        assert_eq!(entry_points(src), ["plain", "bounded"]);
    }

    #[test]
    fn every_kernel_entry_point_is_bundled() {
        let all: Vec<String> = sources()
            .iter()
            .filter(|(n, _)| n.ends_with(".cu"))
            .flat_map(|(_, s)| entry_points(s))
            .collect();
        for k in [
            "embed_streams",
            "embed",
            "gather_rows",
            "last_rows",
            "rms_norm",
            "rms_norm_embed",
            "rms_norm_gather",
            "linear_t1",
            "linear_t1_deep",
            "linear_t16",
            "linear_multi_t1",
            "linear_multi_t2",
            "linear_multi_t4",
            "linear_multi_t8",
            "linear_multi_t16",
            "linear_split",
            "linear_multi_split",
            "linear_mxfp8_t1",
            "linear_mxfp8_t1_deep",
            "linear_mxfp8_t16",
            "linear_multi_mxfp8_t1",
            "linear_multi_mxfp8_t16",
            "add_broadcast",
            "add_broadcast_norm",
            "hc_read_t1",
            "hc_read_t4",
            "hc_read_t4_wide",
            "hc_mix_split",
            "hc_mix_tc_t1",
            "hc_mix_tc_t2",
            "hc_mix_tc_t16",
            "hc_read_one_t1",
            "hc_read_one_t2",
            "hc_read_one_t4",
            "hc_write",
            "hc_write_norm",
            "ple_embed",
            "ple_mix",
            "ple_mix_conv",
            "ple_commit",
            "gdn_conv",
            "gdn_recur",
            "gdn_recur_one",
            "gdn_commit",
            "gated_norm",
            "attn_prep",
            "indexer_prep",
            "attn_index_prep",
            "indexer_score",
            "indexer_select",
            "sparse_attn_g4",
            "sparse_attn_g8",
            "sparse_attn_g12",
            "sparse_attn_g16",
            "sparse_attn_g4v",
            "sparse_attn_g8v",
            "sparse_attn_g12v",
            "sparse_attn_g12e",
            "sparse_attn_combine",
            "sparse_attn_combine_pre",
            "indexer_commit",
            "router_t1",
            "router_t8",
            "router_topk_w",
            "experts",
            "experts_wide",
            "experts_order",
            "experts_down",
            "experts_down_f4",
            "shared_expert_t1",
            "shared_expert_t4",
            "sample",
            "keep_count",
            "read_floor",
        ] {
            assert!(all.iter().any(|e| e == k), "no kernel entry point {k}");
        }
    }

    /// Compiles every kernel for sm_90a. Skips (with a reason) when NVRTC is not on the loader path, unless
    /// `FLASHPLAN_REQUIRE_NVRTC=1` (CI sets it after scripts/setup_nvrtc.sh): then a missing NVRTC fails.
    #[test]
    fn kernels_compile_for_sm_90a() {
        let require = flashplan_plan::env::switch("FLASHPLAN_REQUIRE_NVRTC")
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or(false);
        // SAFETY: only loads the library.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(
                !require,
                "FLASHPLAN_REQUIRE_NVRTC=1 but libnvrtc.so.13 is not on the loader path"
            );
            eprintln!("skipped: NVRTC not found (run scripts/setup_nvrtc.sh)");
            return;
        }
        let mods = compile_kernels("sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert!(mods.iter().all(|m| !m.cubin.is_empty()));
        // The kernels the runtime launches in blocks of up to 1024 threads (runtime/src/cuda/launch: `rms_norm*` by
        // `rows::rms_norm_threads`, add_broadcast, router_topk, indexer_select, sample) have no launch bound (one
        // made ptxas spill in the norms), so nothing else stops ptxas from giving them more than the 64 registers a
        // thread that a 1024-thread block can have (65536 an SM): the launch would then fail on the GPU.
        let regs: std::collections::HashMap<String, u32> = mods
            .iter()
            .flat_map(|m| register_counts(&m.cubin))
            .collect();
        for k in [
            "rms_norm",
            "rms_norm_embed",
            "rms_norm_gather",
            "add_broadcast",
            "router_topk",
            "indexer_select",
            "sample",
        ] {
            let n = regs
                .get(k)
                .unwrap_or_else(|| panic!("no register count for {k}"));
            assert!(
                *n <= 64,
                "{k}: {n} registers a thread; blocks of 1024 threads allow 64"
            );
        }
    }

    /// Registers a thread of each entry point of a cubin: the EIATTR_REGCOUNT records (attribute 0x2f, a symbol index
    /// and a count) of its `.nv.info` section, named through `.symtab` (the same reading as scripts/sass.sh).
    fn register_counts(cubin: &[u8]) -> Vec<(String, u32)> {
        let u16_at = |o: usize| u16::from_le_bytes([cubin[o], cubin[o + 1]]) as usize;
        let u32_at = |o: usize| u32::from_le_bytes(cubin[o..o + 4].try_into().expect("4 bytes"));
        let u64_at =
            |o: usize| u64::from_le_bytes(cubin[o..o + 8].try_into().expect("8 bytes")) as usize;
        let (shoff, shent, shnum, shstr) = (u64_at(0x28), u16_at(0x3A), u16_at(0x3C), u16_at(0x3E));
        // (name offset, offset, size) of each section.
        let secs: Vec<(usize, usize, usize)> = (0..shnum)
            .map(|i| {
                let h = shoff + i * shent;
                (u32_at(h) as usize, u64_at(h + 0x18), u64_at(h + 0x20))
            })
            .collect();
        let cstr = |o: usize| {
            let end = o + cubin[o..].iter().position(|&b| b == 0).expect("NUL");
            String::from_utf8_lossy(&cubin[o..end]).into_owned()
        };
        let section = |name: &str| {
            secs.iter()
                .find(|s| cstr(secs[shstr].1 + s.0) == name)
                .map(|s| (s.1, s.2))
                .unwrap_or_else(|| panic!("no {name} section"))
        };
        let ((symtab, symsize), (strtab, _), (info, infosize)) =
            (section(".symtab"), section(".strtab"), section(".nv.info"));
        let sym = |i: usize| cstr(strtab + u32_at(symtab + 24 * i) as usize);
        assert!(symsize % 24 == 0);
        let mut out = Vec::new();
        let mut o = info;
        while o < info + infosize {
            let (fmt, attr, size) = (cubin[o], cubin[o + 1], u16_at(o + 2));
            if fmt == 4 {
                // EIFMT_SVAL: an attribute with a payload of `size` bytes.
                if attr == 0x2f {
                    out.push((sym(u32_at(o + 4) as usize), u32_at(o + 8)));
                }
                o += 4 + size;
            } else {
                o += 4;
            }
        }
        out
    }
}
