//! Runs the runtime's fuzz target bodies over the checked-in seed corpus.

#[path = "../../fuzz/seed_corpus.rs"]
mod seed_corpus;
use seed_corpus::run_seeds;
use sluice_runtime::fuzz;

#[test]
fn json_target_survives_its_seeds() {
    run_seeds("json", 1, fuzz::json_body);
}

#[test]
fn xml_target_survives_its_seeds() {
    run_seeds("xml", 1, fuzz::xml_document);
}
