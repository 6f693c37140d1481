//! The dashboard embeds third-party browser code (xterm.js) that
//! `scripts/web-assets.sh` fetches from the npm registry, pinned by
//! `assets/package-lock.json`. Without it the build stops here and says
//! what to run, rather than failing on a missing file deep in a macro.

use std::path::Path;

const NEEDED: &[&str] = &[
    "assets/node_modules/@xterm/xterm/lib/xterm.js",
    "assets/node_modules/@xterm/xterm/css/xterm.css",
    "assets/node_modules/@xterm/addon-fit/lib/addon-fit.js",
];

fn main() {
    // Read when it runs, not baked in when it was built: a build script
    // compiled in another checkout of a shared target directory is run
    // again here (when `static` changes) and must look here.
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest);
    for file in NEEDED {
        println!("cargo:rerun-if-changed={file}");
        if !dir.join(file).is_file() {
            panic!(
                "{} is missing: run scripts/web-assets.sh (it runs `npm ci` in crates/web/assets), \
                 which scripts/build.sh and scripts/test.sh do first",
                dir.join(file).display()
            );
        }
    }
    println!("cargo:rerun-if-changed=assets/package-lock.json");
    println!("cargo:rerun-if-changed=static");
}
