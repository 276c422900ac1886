from handle_cli.main import cli

if __name__ == "__main__":
    cli()
