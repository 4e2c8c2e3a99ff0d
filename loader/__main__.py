from loader.cli import main

raise SystemExit(main())
