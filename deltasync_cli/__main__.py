from deltasync_cli import main

main()
