// Shared by the build scripts of the runtime and compiler crates (`include!`d there): bundles the kernel sources
// (kernels/*.cu, *.cuh, *.h) into the binary and generates the Rust mirrors of the parameter structs of
// kernels/params.h (`#[repr(C)]`, same field order and types). The header is written in a restricted style (see its
// top comment), so a line parser suffices: no libclang needed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn kernel_dir() -> PathBuf {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    manifest.parent().expect("workspace root").join("kernels")
}

fn bundle_sources(dir: &Path) -> String {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("kernels/")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            matches!(
                p.extension().and_then(|e| e.to_str()),
                Some("cu") | Some("cuh") | Some("h")
            )
        })
        .collect();
    files.sort();
    let mut out = String::from(
        "/// Kernel sources bundled at build time: (file name, text), sorted by name.\n\
         pub const KERNEL_SOURCES: &[(&str, &str)] = &[\n",
    );
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let name = f.file_name().unwrap().to_string_lossy();
        writeln!(
            out,
            "    ({name:?}, include_str!({:?})),",
            f.display().to_string()
        )
        .unwrap();
    }
    out.push_str("];\n");
    out
}

fn params_mirrors(header: &str) -> String {
    let mut defines: Vec<(String, String)> = Vec::new();
    let mut out = String::from(
        "// Generated from kernels/params.h by kernels/build_bundle.rs. Do not edit.\n",
    );
    let mut in_struct: Option<String> = None;
    let mut fields: Vec<(String, String)> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    for line in header.lines() {
        let line = line
            .split("/*")
            .next()
            .unwrap()
            .split("//")
            .next()
            .unwrap()
            .trim();
        if let Some(rest) = line.strip_prefix("#define ") {
            let mut it = rest.split_whitespace();
            if let (Some(n), Some(v)) = (it.next(), it.next()) {
                if v.chars().all(|c| c.is_ascii_digit()) {
                    defines.push((n.to_string(), v.to_string()));
                    writeln!(out, "pub const {n}: usize = {v};").unwrap();
                }
            }
            continue;
        }
        if let Some(rest) = line.strip_prefix("typedef struct ") {
            let name = rest.trim_end_matches('{').trim().to_string();
            in_struct = Some(name);
            fields.clear();
            continue;
        }
        if let Some(name) = &in_struct {
            if line.starts_with('}') {
                writeln!(out, "\n#[repr(C)]\n#[derive(Debug, Clone, Copy, Default)]\n#[allow(missing_docs)]\npub struct {name} {{").unwrap();
                for (ty, f) in &fields {
                    writeln!(out, "    pub {f}: {ty},").unwrap();
                }
                out.push_str("}\n");
                names.push(name.clone());
                in_struct = None;
                continue;
            }
            if line.is_empty() {
                continue;
            }
            let line = line.trim_end_matches(';');
            let (ty, name) = line.split_once(' ').expect("field: type name");
            let rty = match ty {
                "u64" => "u64".to_string(),
                "u32" => "u32".to_string(),
                "float" => "f32".to_string(),
                other => other.to_string(),
            };
            let name = name.trim();
            if let Some((n, len)) = name.split_once('[') {
                let len = len.trim_end_matches(']');
                let len = defines
                    .iter()
                    .find(|(d, _)| d == len)
                    .map(|(_, v)| v.clone())
                    .unwrap_or_else(|| len.to_string());
                fields.push((format!("[{rty}; {len}]"), n.to_string()));
            } else {
                fields.push((rty, name.to_string()));
            }
        }
    }
    // Layout table: (struct, size, [(field, offset)]) for the ABI check against the C side.
    out.push_str(
        "\n/// (struct name, size, [(field, offset)]) of every mirror, for the ABI check.\n",
    );
    out.push_str(
        "/// (struct name, size, [(field, offset)]).\npub type Layout = (&'static str, usize, Vec<(&'static str, usize)>);\npub fn layouts() -> Vec<Layout> {\n    vec![\n",
    );
    let mut cur: Option<String> = None;
    let mut flist: Vec<String> = Vec::new();
    let flush = |out: &mut String, cur: &Option<String>, flist: &Vec<String>| {
        if let Some(n) = cur {
            let fs: Vec<String> = flist
                .iter()
                .map(|f| format!("({f:?}, std::mem::offset_of!({n}, {f}))"))
                .collect();
            writeln!(
                out,
                "        ({n:?}, std::mem::size_of::<{n}>(), vec![{}]),",
                fs.join(", ")
            )
            .unwrap();
        }
    };
    for line in out.clone().lines() {
        if let Some(rest) = line.strip_prefix("pub struct ") {
            flush(&mut out, &cur, &flist);
            cur = Some(rest.trim_end_matches(" {").to_string());
            flist.clear();
        } else if let Some(rest) = line.strip_prefix("    pub ") {
            if cur.is_some() {
                flist.push(rest.split(':').next().unwrap().to_string());
            }
        }
    }
    flush(&mut out, &cur, &flist);
    out.push_str("    ]\n}\n");
    let _ = names;
    out
}

/// Writes `$OUT_DIR/kernel_sources.rs` and `$OUT_DIR/kernel_params.rs`.
pub fn bundle_kernels() {
    let dir = kernel_dir();
    println!("cargo:rerun-if-changed={}", dir.display());
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    std::fs::write(out_dir.join("kernel_sources.rs"), bundle_sources(&dir)).expect("write");
    let header = std::fs::read_to_string(dir.join("params.h")).expect("kernels/params.h");
    std::fs::write(out_dir.join("kernel_params.rs"), params_mirrors(&header)).expect("write");
}
