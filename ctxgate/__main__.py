from ctxgate.cli import main

raise SystemExit(main())
