from cadence.worker.process import main

main()
