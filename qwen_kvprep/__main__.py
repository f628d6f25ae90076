from qwen_kvprep.cli import main

if __name__ == "__main__":
    main()
