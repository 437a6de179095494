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

fn cache_path(stem: &str, hash: &str, arch: &str) -> Option<std::path::PathBuf> {
    let dir = std::env::var_os("FLASHPLAN_KERNEL_CACHE")?;
    Some(std::path::PathBuf::from(dir).join(format!("{stem}-{}-{arch}.cubin", &hash[..16])))
}

/// Compiles every bundled `.cu` module for `arch` (e.g. `sm_90a`) into cubin.
///
/// # Errors
/// [`NvrtcError`] when NVRTC is missing, or a module fails or prints any diagnostic.
pub fn compile_kernels(arch: &str) -> Result<Vec<KernelModule>, NvrtcError> {
    if !arch.starts_with("sm_") {
        return Err(NvrtcError::Arch(arch.to_string()));
    }
    let mut out = Vec::new();
    for (name, src) in sources().iter().filter(|(n, _)| n.ends_with(".cu")) {
        let stem = name.trim_end_matches(".cu").to_string();
        let hash = module_hash(name, src);
        let cached = cache_path(&stem, &hash, arch).and_then(|p| std::fs::read(p).ok());
        let cubin = match cached {
            Some(c) => c,
            None => {
                let c = compile_one(name, src, arch)?;
                if let Some(p) = cache_path(&stem, &hash, arch) {
                    if let Some(d) = p.parent() {
                        let _ = std::fs::create_dir_all(d);
                    }
                    let _ = std::fs::write(&p, &c);
                }
                c
            }
        };
        out.push(KernelModule {
            name: stem,
            source_hash: hash,
            cubin,
            entry_points: entry_points(src),
        });
    }
    Ok(out)
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
            "linear_mxfp8_t16",
            "add_broadcast",
            "hc_read_t1",
            "hc_read_t4",
            "hc_read_t4_wide",
            "hc_mix_split",
            "hc_mix_tc_t1",
            "hc_mix_tc_t2",
            "hc_mix_tc_t16",
            "hc_write",
            "hc_write_norm",
            "ple_embed",
            "ple_mix",
            "ple_mix_conv",
            "ple_commit",
            "gdn_conv",
            "gdn_recur",
            "gdn_commit",
            "gated_norm",
            "attn_prep",
            "indexer_prep",
            "indexer_select",
            "sparse_attn",
            "indexer_commit",
            "router_t1",
            "router_t8",
            "experts",
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
        // SAFETY: only loads the library.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        if !present {
            assert!(
                std::env::var("FLASHPLAN_REQUIRE_NVRTC").as_deref() != Ok("1"),
                "FLASHPLAN_REQUIRE_NVRTC=1 but libnvrtc.so.13 is not on the loader path"
            );
            eprintln!("skipped: NVRTC not found (run scripts/setup_nvrtc.sh)");
            return;
        }
        let mods = compile_kernels("sm_90a").unwrap_or_else(|e| panic!("{e}"));
        assert!(mods.iter().all(|m| !m.cubin.is_empty()));
    }
}
