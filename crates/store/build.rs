//! The migrations are embedded by `sqlx::migrate!`, which cargo does not
//! know reads `migrations/`: a migration added without a change to the
//! crate's code would be missed by an incremental build.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
