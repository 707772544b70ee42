from toolenv.cli import main

main()
