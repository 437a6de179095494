// Bundles the kernel sources and generates the Rust mirrors of kernels/params.h (see kernels/build_bundle.rs).
include!("../kernels/build_bundle.rs");

fn main() {
    bundle_kernels();
}
