from localinfer.cli.app import main

main()
