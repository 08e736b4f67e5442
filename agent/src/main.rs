//! `baleen-agent`: parses the command line and hands over to [`baleen_agent::cli::run`]; errors
//! are printed with their causes and become the exit code the library chooses.

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = baleen_agent::cli::Cli::parse();
    match baleen_agent::cli::run(cli, &mut std::io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            let code = err.exit_code();
            eprintln!("baleen-agent: {:#}", anyhow::Error::new(err));
            ExitCode::from(code)
        }
    }
}
