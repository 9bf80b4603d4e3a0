// `sqlx::migrate!` embeds `migrations/` at compile time; a migration added or
// edited rebuilds the crate only when cargo is told the directory matters.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
