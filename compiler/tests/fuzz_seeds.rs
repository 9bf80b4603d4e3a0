//! Runs the compiler's fuzz target bodies over the checked-in seed corpus.

#[path = "../../fuzz/seed_corpus.rs"]
mod seed_corpus;
use seed_corpus::run_seeds;
use sluice_compiler::fuzz;

#[test]
fn workflow_target_survives_its_seeds() {
    run_seeds("workflow", 7, fuzz::workflow_definition);
}

#[test]
fn logic_target_survives_its_seeds() {
    run_seeds("logic", 5, fuzz::logic_rule);
}

#[test]
fn sql_target_survives_its_seeds() {
    run_seeds("sql", 1, fuzz::sql_statement);
}
