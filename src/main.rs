fn main() -> std::process::ExitCode {
    ironcell::cli::main()
}
