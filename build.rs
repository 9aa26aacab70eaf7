//! Link against the libpython that pyo3 configured for, and record its directory as an rpath so
//! the loader cannot pick a different `libpython3.x.so` at run time (DESIGN.md §8).
fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
    println!("cargo:rerun-if-changed=python");
    println!("cargo:rerun-if-changed=sandbox-policy");
}
