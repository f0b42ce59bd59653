from capd.cli import main

main()
