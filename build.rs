//! Embeds the CUDA sources of `kernels/*.cu` in the extension module, so the wheel ships them
//! inside `nybble._core` (`kernel_sources()`), wherever the package is installed.

use std::{env, fs, path::PathBuf};

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let dir = root.join("kernels");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut entries: Vec<PathBuf> = fs::read_dir(&dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    entries.retain(|p| p.extension().is_some_and(|e| e == "cu" || e == "cuh"));
    entries.sort();
    let mut code = String::from("pub const KERNEL_SOURCES: &[(&str, &str)] = &[\n");
    for path in &entries {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path.file_name().expect("a file").to_string_lossy();
        code += &format!(
            "    ({name:?}, include_str!({:?})),\n",
            path.display().to_string()
        );
    }
    code += "];\n";
    let out = PathBuf::from(env::var("OUT_DIR").expect("set by cargo")).join("kernels.rs");
    fs::write(out, code).expect("write kernels.rs");
}
