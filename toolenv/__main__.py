from toolenv.entry import main

main()
